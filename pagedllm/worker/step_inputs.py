"""A step's model inputs (`StepInputs`) and the host-side arithmetic that builds them
from the scheduler's output and the input batch: each token's position and KV slot, the
block tables of each KV cache group, the placeholders of tokens the device has not
handed back yet, the logits rows that verify proposals and the grammar masks' rows.
ModelRunner._prepare_inputs drives these and moves the result to the device."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata, host_to_device
from pagedllm.core.contracts import SchedulerOutput
from pagedllm.lora_request import LoRARequest
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.worker.deferred_sample import DeferredSample
from pagedllm.worker.input_batch import InputBatch


@dataclass
class StepInputs:
    """Model inputs of one step, in scheduling order."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn_metadata: AttentionMetadata
    req_ids: list[str]
    # Flattened token index of each sampling request's last scheduled token; None when
    # every token of the step samples (each request decodes one), in order.
    logits_indices: torch.Tensor | None  # [N]
    # Rows (in the input batch) of the requests that sample, in logits order.
    sample_rows: np.ndarray
    # Position of each sampling request in req_ids.
    sample_positions: np.ndarray
    # Row (in the input batch) of each request of req_ids.
    rows: np.ndarray
    # Speculative decoding (None in a step without proposals): per sampling request,
    # its logits rows (1 + its proposals, consecutive in logits_indices) and its
    # proposals (None where it has none).
    num_logits: np.ndarray | None = None
    drafts: list[list[int] | None] | None = None
    # Per request of req_ids: tokens computed before this step, and scheduled in it.
    num_computed: np.ndarray | None = None
    num_scheduled: np.ndarray | None = None
    # The CUDA graph bucket the step replays in (its inputs staged there), or None.
    graph_bucket: int | None = None
    # Structured output: the grammar bitmask rows of the step (SchedulerOutput's) and
    # the logits row each applies to; None when no request samples under a grammar.
    grammar: tuple[np.ndarray, list[int]] | None = None
    # LoRA: each token's adapter id (0: none), and the step's adapters by id; None when
    # no token of the step has one.
    lora_ids: np.ndarray | None = None
    loras: dict[int, LoRARequest] | None = None


def token_positions(computed: np.ndarray, num_scheduled: np.ndarray,
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(query_start_loc [R + 1], positions [T], req_of [T]) of a step whose requests
    have computed `computed` [R] tokens and are scheduled `num_scheduled` [R] more:
    token t belongs to request req_of[t] and sits at position computed + offset."""
    query_start_loc = np.zeros(len(num_scheduled) + 1, dtype=np.int64)
    np.cumsum(num_scheduled, out=query_start_loc[1:])
    total = int(query_start_loc[-1])
    req_of = np.repeat(np.arange(len(num_scheduled)), num_scheduled)
    positions = computed[req_of] + (np.arange(total) - query_start_loc[req_of])
    return query_start_loc, positions, req_of


def write_drafts(batch: InputBatch, spec: dict[str, list[int]]) -> None:
    """Proposed tokens follow their request's tokens in its row (not counted in
    num_tokens: overwritten by whatever is emitted)."""
    for req_id, drafts in spec.items():
        row = batch.req_id_to_row[req_id]
        start = int(batch.num_tokens[row])
        batch.token_ids[row, start:start + len(drafts)] = drafts


def slot_tables(batch: InputBatch, group_windows: tuple[int | None, ...], block_size: int,
                rows: np.ndarray, token_rows: np.ndarray, positions: np.ndarray,
                computed: np.ndarray, num_blocks: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per KV cache group: (block table [R, num_blocks], slot mapping [T])."""
    tables = []
    for group, window in enumerate(group_windows):
        # slot = block_table[pos // block_size] * block_size + pos % block_size
        block_ids = batch.block_tables[group, token_rows, positions // block_size]
        slot_mapping = block_ids.astype(np.int64) * block_size + positions % block_size
        block_table = batch.block_tables[group, rows, :num_blocks]  # a copy
        if window is not None:
            # Blocks out of the window were given back: the null block in their
            # place (the scheduler's rule, kv_groups.num_skipped_blocks).
            skip = np.maximum(computed - window + 1, 0) // block_size
            block_table[np.arange(num_blocks) < skip[:, None]] = 0
        tables.append((block_table, slot_mapping))
    return tables


def placeholders(batch: InputBatch, unread: list[DeferredSample], token_rows: np.ndarray,
                 positions: np.ndarray, rows: np.ndarray,
                 ) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray]:
    """Where a step's tokens are still on the device: ((index of the token in the
    step, its index in the unread step's sampled ids), per request of the step
    whether it has one). A placeholder is the position after the tokens the host
    knows; the engine reads each step before it schedules the one after next, so
    one step at most is unread and a request has at most one placeholder."""
    assert len(unread) == 1, "more than one step's sampled ids unread"
    source = np.full(batch.max_num_reqs, -1, dtype=np.int64)
    live = batch.generation[unread[0].rows] == unread[0].generations
    source[unread[0].rows[live]] = np.nonzero(live)[0]
    token_index = np.nonzero(positions >= batch.num_tokens[token_rows])[0]
    sample_index = source[token_rows[token_index]]
    # (One unread step: one sampled token per request, so one placeholder at most.)
    assert (sample_index >= 0).all(), "a token past the known ones has no sample"
    return (token_index, sample_index), source[rows] >= 0


def verify_rows(logits_indices: np.ndarray, drafts: list[list[int] | None],
                ) -> tuple[np.ndarray, np.ndarray]:
    """(num_logits [N], logits_indices [sum]) of a step with proposals: a request with
    k proposals samples at its last k + 1 positions (logits_indices: each sampling
    request's last token)."""
    num_logits = np.array([1 + len(d) if d else 1 for d in drafts], dtype=np.int64)
    first = np.repeat(logits_indices - num_logits + 1, num_logits)
    offsets = np.arange(int(num_logits.sum())) - np.repeat(
        np.cumsum(num_logits) - num_logits, num_logits)
    return num_logits, first + offsets


def grammar_rows(so: SchedulerOutput, req_ids: list[str], sample_positions: np.ndarray,
                 num_logits: np.ndarray | None) -> tuple[np.ndarray, list[int]]:
    """StepInputs.grammar: the step's bitmask rows and the logits row each applies to,
    each sampling request's first (its only one without proposals; a request under a
    grammar never has proposals)."""
    first = (np.arange(len(sample_positions)) if num_logits is None
             else np.cumsum(num_logits) - num_logits)
    logits_row = dict(zip([req_ids[p] for p in sample_positions.tolist()], first.tolist()))
    bitmask_rows = list(so.structured_output_rows.values())
    return (so.grammar_bitmask[bitmask_rows],
            [logits_row[req_id] for req_id in so.structured_output_rows])


def apply_grammar(md: SamplingMetadata, grammar: tuple[np.ndarray, list[int]] | None,
                  num_rows: int, device: torch.device) -> None:
    """The step's grammar bitmask into `md`: [num_rows (the logits rows), words], all
    tokens allowed in the rows without a grammar (the sampler masks only
    md.grammar_rows)."""
    if grammar is None:
        return
    bitmask_rows, logits_rows = grammar
    bitmask = np.full((num_rows, bitmask_rows.shape[1]), -1, dtype=np.int32)
    bitmask[logits_rows] = bitmask_rows
    md.grammar_bitmask = host_to_device(bitmask, device)
    md.grammar_rows = logits_rows
