"""Paged-attention kernels: one varlen kernel for mixed prefill/decode batches, with a
split-KV mode whose partial results a second kernel merges.

Work split of `_paged_attention_kernel` (grid [num_q_tiles, num_kv_heads, num_partitions]):

    program (tile, kv_head, part) -> one query tile of one request x the GROUP query
    heads sharing kv_head, over the keys of partition `part` (all keys unless split)

    tile rows (BLOCK_M of them):  r = t * GROUP + g
        t = r // GROUP: query token q_tile * BLOCK_Q + t of the request
        g = r %  GROUP: query head kv_head * GROUP + g
    so each K/V tile is loaded once and used by every query head of its group (GQA/MQA).

A request's queries are the last q_len positions of its seq_len-long context:
query token t sits at position context_len + t, context_len = seq_len - q_len, and sees
keys 0 .. its own position (causal within the chunk, full over the cached context),
minus those at least `sliding_window` positions older. Keys are read in TILE_N-key tiles
through the block table (key at position p: block block_table[p // BLOCK_SIZE], offset
p % BLOCK_SIZE); an online softmax carries (row max, row sum, accumulator) across tiles.

An fp8 cache (attention/kv_quant.py) is loaded as fp8 and converted to the dot dtype with
the tiles (exact: every fp8 value is a float16 / bfloat16); its k_scale arrives folded
into `scale` and v_scale multiplies the result once, in `_store_result`.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _find_request(query_start_loc_ptr, tile, num_reqs, BLOCK_Q: tl.constexpr):
    """The request owning query tile `tile` (binary search).

    Request i's tiles are numbered from query_start_loc[i] // BLOCK_Q + i: that leaves it
    at least cdiv(q_len_i, BLOCK_Q) numbers, since the floors of the prefix sums grow by
    at least floor(q_len_i / BLOCK_Q) and the `+ i` adds one more per request. Launching
    num_tokens // BLOCK_Q + num_reqs tiles therefore covers every request without a host
    sync; numbers a request does not need exit at once.
    """
    lo: tl.int32 = 0
    hi = num_reqs  # the answer is in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def _tanh(x):
    # tanh(x) = 1 - 2 / (exp(2x) + 1): saturates to +-1 instead of inf / inf = nan.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _load_kv_tile(key_cache_ptr, value_cache_ptr, block_table_row_ptr, k_pos, kv_end,
                  kv_head, dims, dim_valid, stride_cache_block, stride_cache_slot,
                  stride_cache_head, BLOCK_SIZE: tl.constexpr):
    """K^T [HEAD_PAD, TILE_N] and V [TILE_N, HEAD_PAD] of the keys at positions k_pos;
    keys at or past kv_end (and padded dims) read as 0."""
    k_valid = k_pos < kv_end
    # Key at position p lives in slot block_table[p // BLOCK_SIZE] * BLOCK_SIZE
    # + p % BLOCK_SIZE; invalid keys read the null block's id (never dereferenced).
    block_id = tl.load(block_table_row_ptr + k_pos // BLOCK_SIZE, mask=k_valid, other=0)
    key_offset = (block_id.to(tl.int64) * stride_cache_block
                  + (k_pos % BLOCK_SIZE) * stride_cache_slot + kv_head * stride_cache_head)
    k_t = tl.load(key_cache_ptr + key_offset[None, :] + dims[:, None],
                  mask=dim_valid[:, None] & k_valid[None, :], other=0.0)
    v = tl.load(value_cache_ptr + key_offset[:, None] + dims[None, :],
                mask=k_valid[:, None] & dim_valid[None, :], other=0.0)
    return k_t, v


@triton.jit
def _score_tile(q, k_t, q_pos, k_pos, alibi_slope, scale, soft_cap, sliding_window,
                USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
                USE_ALIBI: tl.constexpr, DOT_DTYPE: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """Masked float32 scores [BLOCK_M, TILE_N], in torch_ref's order: scale, soft-cap,
    then the causal / window mask and the ALiBi bias."""
    s = tl.dot(q, k_t.to(DOT_DTYPE), input_precision=DOT_PRECISION) * scale
    if USE_SOFT_CAP:
        s = soft_cap * _tanh(s / soft_cap)
    rel = k_pos[None, :] - q_pos[:, None]  # <= 0 for keys at or before the query
    visible = rel <= 0
    if USE_WINDOW:
        # A query sees itself and the sliding_window - 1 keys before it.
        visible = visible & (rel > -sliding_window)
    s = tl.where(visible, s, float("-inf"))
    if USE_ALIBI:
        s = s + alibi_slope[:, None] * rel.to(tl.float32)
    return s


@triton.jit
def _softmax_step(s, v, m_i, l_i, acc, DOT_DTYPE: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """Fold one tile of scores s [BLOCK_M, TILE_N] and values v into the running row max
    m_i, row sum l_i and accumulator acc (all float32)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with no visible key so far keeps max -inf; subtract 0 instead so that
    # exp(-inf - -inf) never makes a nan (its p and alpha are then exp(-inf) = 0).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE),
                                        input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _key_range(context_len, q_len, q_tile, sliding_window, BLOCK_Q: tl.constexpr,
               TILE_N: tl.constexpr, USE_WINDOW: tl.constexpr, IS_SPLIT: tl.constexpr,
               PARTITION_SIZE: tl.constexpr):
    """[kv_start, kv_end) of the keys a query tile reads: up to its last query's
    position, from its first query's window; start aligned down to a key tile (the
    per-row masks drop the extra keys)."""
    kv_end = context_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
    kv_start = kv_end * 0
    if USE_WINDOW:
        kv_start = tl.maximum(context_len + q_tile * BLOCK_Q - sliding_window + 1, 0)
    if IS_SPLIT:
        # Partition `part` owns keys [part * PARTITION_SIZE, (part + 1) * PARTITION_SIZE);
        # PARTITION_SIZE is a multiple of TILE_N, so no key tile straddles two partitions.
        part = tl.program_id(2)
        kv_start = tl.maximum(kv_start, part * PARTITION_SIZE)
        kv_end = tl.minimum(kv_end, (part + 1) * PARTITION_SIZE)
    return kv_start // TILE_N * TILE_N, kv_end


@triton.jit
def _store_result(out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr, m_i, l_i, acc,
                  v_scale, token, head, dims, row_valid, dim_valid, num_partitions,
                  stride_out_token, stride_out_head, NUM_HEADS: tl.constexpr,
                  HEAD_PAD: tl.constexpr, IS_SPLIT: tl.constexpr):
    """The normalized rows into out, or (split) the unnormalized partials at
    [token, head, part]; an empty partition stores (-inf, 0, 0), which the reduce
    weighs by exp(-inf) = 0. acc sums unscaled values: v_scale applies here (1 unless
    the cache is fp8)."""
    acc = acc * v_scale
    if IS_SPLIT:
        part_idx = (token * NUM_HEADS + head) * num_partitions + tl.program_id(2)
        tl.store(part_max_ptr + part_idx, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part_idx, l_i, mask=row_valid)
        tl.store(part_acc_ptr + part_idx[:, None] * HEAD_PAD + dims[None, :], acc,
                 mask=row_valid[:, None])
    else:
        # Every valid row sees at least its own key, so l_i > 0 there.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + token[:, None] * stride_out_token
                 + head[:, None] * stride_out_head + dims[None, :],
                 out.to(out_ptr.dtype.element_ty),
                 mask=row_valid[:, None] & dim_valid[None, :])


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [T, H, D]
    query_ptr,  # [T, H, D]
    key_cache_ptr, value_cache_ptr,  # [num_blocks, block_size, KVH, D] each
    block_table_ptr,  # [num_reqs, max_num_blocks] int32
    seq_lens_ptr,  # [num_reqs] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    alibi_slopes_ptr,  # [H] float32 (USE_ALIBI)
    part_max_ptr, part_sum_ptr,  # [T, H, num_partitions] float32 (IS_SPLIT)
    part_acc_ptr,  # [T, H, num_partitions, HEAD_PAD] float32 (IS_SPLIT)
    # NOTE: typed, so a value of 1 is not specialized into a constexpr, which
    # _find_request's loop reassigns (some Triton releases reject that).
    num_reqs: tl.int32,
    num_partitions, scale, v_scale, soft_cap, sliding_window,
    stride_query_token, stride_query_head, stride_out_token, stride_out_head,
    stride_cache_block, stride_cache_slot, stride_cache_head, stride_block_table,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    ONE_TILE_PER_REQ: tl.constexpr, IS_SPLIT: tl.constexpr, PARTITION_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr, USE_ALIBI: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    kv_head = tl.program_id(1)
    if ONE_TILE_PER_REQ:
        # Every query fits one tile (BLOCK_Q >= max query length): tile i is request i.
        req = tl.program_id(0)
        q_tile = req * 0
    else:
        req = _find_request(query_start_loc_ptr, tl.program_id(0), num_reqs, BLOCK_Q)
        q_tile = tl.program_id(0) - (tl.load(query_start_loc_ptr + req) // BLOCK_Q + req)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    context_len = tl.load(seq_lens_ptr + req) - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + rows // GROUP  # query token within the request
    head = kv_head * GROUP + rows % GROUP
    # BLOCK_M is a power of two >= 16: rows past BLOCK_Q * GROUP are padding.
    row_valid = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = context_len + tok
    token = (q_start + tok).to(tl.int64)
    dims = tl.arange(0, HEAD_PAD)
    dim_valid = dims < HEAD_SIZE  # head sizes are padded to a power of two
    q = tl.load(query_ptr + token[:, None] * stride_query_token
                + head[:, None] * stride_query_head + dims[None, :],
                mask=row_valid[:, None] & dim_valid[None, :], other=0.0).to(DOT_DTYPE)
    alibi_slope = tl.zeros([BLOCK_M], tl.float32)
    if USE_ALIBI:
        alibi_slope = tl.load(alibi_slopes_ptr + head, mask=row_valid, other=0.0)

    kv_start, kv_end = _key_range(context_len, q_len, q_tile, sliding_window, BLOCK_Q,
                                  TILE_N, USE_WINDOW, IS_SPLIT, PARTITION_SIZE)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    block_table_row_ptr = block_table_ptr + req.to(tl.int64) * stride_block_table
    for tile_start in range(kv_start, kv_end, TILE_N):
        k_pos = tile_start + tl.arange(0, TILE_N)
        k_t, v = _load_kv_tile(key_cache_ptr, value_cache_ptr, block_table_row_ptr, k_pos,
                               kv_end, kv_head, dims, dim_valid, stride_cache_block,
                               stride_cache_slot, stride_cache_head, BLOCK_SIZE)
        s = _score_tile(q, k_t, q_pos, k_pos, alibi_slope, scale, soft_cap, sliding_window,
                        USE_WINDOW, USE_SOFT_CAP, USE_ALIBI, DOT_DTYPE, DOT_PRECISION)
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, DOT_DTYPE, DOT_PRECISION)

    _store_result(out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr, m_i, l_i, acc, v_scale,
                  token, head, dims, row_valid, dim_valid, num_partitions, stride_out_token,
                  stride_out_head, NUM_HEADS, HEAD_PAD, IS_SPLIT)


@triton.jit
def _reduce_partitions_kernel(
    out_ptr,  # [T, H, D]
    part_max_ptr, part_sum_ptr,  # [T, H, num_partitions]
    part_acc_ptr,  # [T, H, num_partitions, HEAD_PAD]
    num_partitions, stride_out_token, stride_out_head,
    NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    PARTITIONS_PAD: tl.constexpr,
):
    """One program per (token, head): merge the partitions' (max m_p, sum l_p, acc_p) by
    log-sum-exp: with M = max_p m_p and w_p = exp(m_p - M),
    out = sum_p w_p * acc_p / sum_p w_p * l_p."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    parts = tl.arange(0, PARTITIONS_PAD)
    part_valid = parts < num_partitions
    part_idx = (token * NUM_HEADS + head) * num_partitions + parts
    m_p = tl.load(part_max_ptr + part_idx, mask=part_valid, other=float("-inf"))
    l_p = tl.load(part_sum_ptr + part_idx, mask=part_valid, other=0.0)
    # M is finite: the partition holding the query's own key saw it.
    w_p = tl.exp(m_p - tl.max(m_p, 0))
    dims = tl.arange(0, HEAD_PAD)
    acc_p = tl.load(part_acc_ptr + part_idx[:, None] * HEAD_PAD + dims[None, :],
                    mask=part_valid[:, None], other=0.0)
    out = tl.sum(acc_p * w_p[:, None], 0) / tl.sum(w_p * l_p, 0)
    tl.store(out_ptr + token * stride_out_token + head * stride_out_head + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_SIZE)
