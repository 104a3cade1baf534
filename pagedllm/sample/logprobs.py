"""Top-k logprobs and the rank of a chosen token, batched, and their host conversion."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.core.contracts import SampleLogprobs


@dataclass
class LogprobsTensors:
    """Column 0 is the chosen token, columns 1..k the top-k (ranks 1..k)."""

    token_ids: torch.Tensor  # [N, k + 1] int64
    logprobs: torch.Tensor  # [N, k + 1] float32
    ranks: torch.Tensor  # [N] int64: rank of the chosen token (1 = most likely)

    def tolists(self, num_logprobs: list[int]) -> list[SampleLogprobs | None]:
        """Per row: SampleLogprobs with its own k (None where k < 0: not requested).

        One host transfer for the whole batch.
        """
        ids, lps, ranks = (self.token_ids.tolist(), self.logprobs.tolist(),
                           self.ranks.tolist())
        return [SampleLogprobs(token_ids=ids[i][:k + 1], logprobs=lps[i][:k + 1],
                               chosen_rank=ranks[i]) if k >= 0 else None
                for i, k in enumerate(num_logprobs)]


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int,
                    ) -> LogprobsTensors:
    """logprobs [N, V] (a log-softmax), token_ids [N] -> chosen + top-k with ranks.

    rank = number of tokens at least as likely as the chosen one (ties count against it,
    as vLLM), so the argmax has rank 1.
    """
    chosen = logprobs.gather(1, token_ids[:, None])  # [N, 1]
    ranks = (logprobs >= chosen).sum(dim=-1)
    if k > 0:
        top_lp, top_ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        ids = torch.cat([token_ids[:, None], top_ids], dim=1)
        lps = torch.cat([chosen, top_lp], dim=1)
    else:
        ids, lps = token_ids[:, None], chosen
    return LogprobsTensors(token_ids=ids, logprobs=lps, ranks=ranks)
