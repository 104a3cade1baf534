"""Top-k logprobs and the ranks of a chosen token and of the top-k, batched, and their
host conversion."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.core.contracts import TokenLogprobs
from pagedllm.kernels.cpu import ops as cpu_ops
from pagedllm.kernels.cpu.ops import cpu_ops_available

# Most top-k entries score_logprobs asks of the native op, which keeps them in an
# insertion-sorted list (k in the hundreds would make it slow; max_logprobs -1 allows
# the whole vocabulary): beyond, torch.topk.
MAX_NATIVE_TOP_K = 64


@dataclass
class LogprobsTensors:
    """Column 0 is the chosen token, columns 1..k the top-k (most likely first)."""

    token_ids: torch.Tensor  # [N, k + 1] int64
    logprobs: torch.Tensor  # [N, k + 1] float32
    # [N, k + 1] int64: rank of each column's token in the full distribution (1 = most
    # likely; tied tokens share a rank).
    ranks: torch.Tensor

    def tolists(self, num_logprobs: list[int]) -> list[TokenLogprobs | None]:
        """Per row: TokenLogprobs with its own k (None where k < 0: not requested).

        One host transfer for the whole batch.
        """
        ids, lps, ranks = (self.token_ids.tolist(), self.logprobs.tolist(),
                           self.ranks.tolist())
        return [TokenLogprobs(token_ids=ids[i][:k + 1], logprobs=lps[i][:k + 1],
                              ranks=ranks[i][:k + 1]) if k >= 0 else None
                for i, k in enumerate(num_logprobs)]


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int,
                    ) -> LogprobsTensors:
    """logprobs [N, V] (a log-softmax), token_ids [N] -> chosen + top-k with ranks.

    rank = 1 + the number of vocabulary entries with a strictly larger logprob: tied
    tokens share a rank and a greedy (argmax) token is always rank 1, whichever of a tie
    argmax picked. NOTE: vLLM counts ties against the token (`>=` in
    `batched_count_greater_than`), so a tied argmax there can get rank 2.
    """
    chosen = logprobs.gather(1, token_ids[:, None])  # [N, 1]
    chosen_ranks = 1 + (logprobs > chosen).sum(dim=-1, keepdim=True)  # [N, 1]
    if k <= 0:
        return LogprobsTensors(token_ids=token_ids[:, None], logprobs=chosen,
                               ranks=chosen_ranks)
    top_lp, top_ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)  # [N, k]
    # Every token more likely than a top-k token is itself in the top-k, so comparing
    # within the top-k counts the whole vocabulary: [N, k, 1] < [N, 1, k] -> [N, k].
    top_ranks = 1 + (top_lp[:, :, None] < top_lp[:, None, :]).sum(dim=-1)
    return LogprobsTensors(token_ids=torch.cat([token_ids[:, None], top_ids], dim=1),
                           logprobs=torch.cat([chosen, top_lp], dim=1),
                           ranks=torch.cat([chosen_ranks, top_ranks], dim=1))


def score_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """gather_logprobs(log_softmax(logits), token_ids, k) for logits [N, V] of any float
    dtype (scored in float32).

    On CPU one native call (cpu_ops.score_rows, k <= MAX_NATIVE_TOP_K): three reads of
    a row, nothing written but the k + 1 entries, ~10x less than torch's float32 copy,
    log-softmax, [N, V] comparison and topk; the top-k ties go to the smaller id. Rows
    holding a NaN or no finite value, and every other device, take torch's path.
    """
    k = min(k, logits.shape[-1])
    if (logits.dim() == 2 and logits.stride(1) == 1 and 0 <= k <= MAX_NATIVE_TOP_K
            and cpu_ops_available(logits)):
        n = logits.shape[0]
        lp = torch.empty(n, k + 1, dtype=torch.float32)
        ids = torch.empty(n, k + 1, dtype=torch.int64)
        ranks = torch.empty(n, k + 1, dtype=torch.int64)
        ok = torch.empty(n, dtype=torch.bool)
        token_ids = token_ids.to(torch.int64).contiguous()
        cpu_ops.score_rows(lp, ids, ranks, ok, logits, token_ids, k)
        if not bool(ok.all()):
            bad = (~ok).nonzero().squeeze(1)
            rest = gather_logprobs(torch.log_softmax(logits[bad].float(), dim=-1),
                                   token_ids[bad], k)
            lp[bad], ids[bad], ranks[bad] = rest.logprobs, rest.token_ids, rest.ranks
        return LogprobsTensors(token_ids=ids, logprobs=lp, ranks=ranks)
    return gather_logprobs(torch.log_softmax(logits.float(), dim=-1), token_ids, k)


def put_label_logprobs(lp: LogprobsTensors, values: torch.Tensor,
                       label_ids: dict[int, torch.Tensor], as_logits: bool) -> None:
    """Rows that name their tokens (SamplingParams.logprob_token_ids): columns 1..n of
    row i become label_ids[i] in their order, with their log-softmax of `values` (the
    values themselves `as_logits`) and ranks, in place of the top-n. `lp` has at least
    n + 1 columns (its k is the batch's most, which counts these rows' n)."""
    for row, ids in label_ids.items():
        v = values[row].float()
        if not as_logits:
            v = torch.log_softmax(v, dim=-1)
        picked = v[ids]
        n = ids.numel()
        lp.token_ids[row, 1:1 + n] = ids
        lp.logprobs[row, 1:1 + n] = picked
        lp.ranks[row, 1:1 + n] = 1 + (v[None, :] > picked[:, None]).sum(dim=-1)
