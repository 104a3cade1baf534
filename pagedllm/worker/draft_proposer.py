"""Draft-model proposals for speculative decoding (vLLM's draft model method).

A smaller model of the same vocabulary runs beside the target, with its own K/V in the
same block ids (its cache tensors have the target's block count and are indexed by the
target's block tables), so prefix-cache hits, preemption and swapping hold for both.
Each step, after the target emitted its tokens, the draft:

1. catches up: runs every request of the step over the positions the target computed
   that stand (the step's tokens less rejected proposals) plus the token just emitted,
   which keeps its K/V equal to the sequence's;
2. proposes greedily: the argmax after the last position, then k - 1 one-token steps
   fed with its own proposals (their K/V lands in the lookahead slots the scheduler
   reserved, and is overwritten by the next catch-up).

Proposals are the draft's argmax (a one-hot proposal), which the verification of
sample/rejection_sampler.py turns into exactly the target's distribution.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata, host_to_device
from pagedllm.sample.ops import argmax_rows
from pagedllm.worker.input_batch import InputBatch


class DraftModelProposer:
    def __init__(self, model: nn.Module, num_speculative_tokens: int, block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.device = device

    def propose(self, batch: InputBatch, rows: np.ndarray, starts: np.ndarray,
                ends: np.ndarray, proposing: np.ndarray) -> list[list[int]]:
        """Per request of the step (its `rows`): catch up over positions
        [starts[i], ends[i]), then propose up to k tokens after ends[i] where
        `proposing[i]` ([] elsewhere, and where the request's blocks hold no slot for
        them)."""
        capacity = batch.num_blocks[0, rows] * self.block_size
        # A slot for every position written: the catch-up's, then k - 1 proposals'.
        ends = np.minimum(ends, capacity)
        num_props = np.where(proposing & (ends == batch.num_tokens[rows]),
                             np.minimum(self.k, capacity - ends + 1), 0)
        counts = ends - starts
        keep = counts > 0
        rows, starts, counts, num_props = rows[keep], starts[keep], counts[keep], \
            num_props[keep]
        proposals: list[list[int]] = [[] for _ in range(len(keep))]
        if not len(rows):
            return proposals
        req_of = np.repeat(np.arange(len(rows)), counts)
        positions = starts[req_of] + (np.arange(int(counts.sum())) - np.repeat(
            np.cumsum(counts) - counts, counts))
        input_ids = batch.token_ids[rows[req_of], positions]
        tokens = self._forward_last(batch, rows, starts, counts, input_ids, positions)
        # Requests still proposing, their next position and their proposals so far.
        active = np.flatnonzero(num_props > 0)
        drafts = [[tok] for tok in tokens[active].tolist()]
        pos = starts[active] + counts[active]
        for j in range(1, self.k):
            more = num_props[active] > j
            if not more.any():
                break
            sel = np.flatnonzero(more)
            last = np.array([drafts[i][-1] for i in sel], dtype=np.int64)
            ones = np.ones(len(sel), dtype=np.int64)
            next_tokens = self._forward_last(batch, rows[active[sel]], pos[sel], ones, last,
                                             pos[sel])
            for i, tok in zip(sel.tolist(), next_tokens.tolist()):
                drafts[i].append(tok)
            pos[sel] += 1
        out_index = np.flatnonzero(keep)[active]
        for i, draft in zip(out_index.tolist(), drafts):
            proposals[i] = draft
        return proposals

    def _forward_last(self, batch: InputBatch, rows: np.ndarray, starts: np.ndarray,
                      counts: np.ndarray, input_ids: np.ndarray, positions: np.ndarray,
                      ) -> np.ndarray:
        """Run the draft over `counts[i]` tokens of request i from position starts[i];
        the argmax after each request's last token."""
        dev, block_size = self.device, self.block_size
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start_loc[1:])
        seq_lens = starts + counts
        num_blocks = -(-int(seq_lens.max()) // block_size)
        token_rows = np.repeat(rows, counts)
        block_ids = batch.block_tables[0, token_rows, positions // block_size]
        slot_mapping = block_ids.astype(np.int64) * block_size + positions % block_size
        md = AttentionMetadata.from_host(query_start_loc, seq_lens,
                                         batch.block_tables[0, rows, :num_blocks],
                                         slot_mapping, dev)
        hidden = self.model(host_to_device(np.ascontiguousarray(input_ids), dev),
                            host_to_device(np.ascontiguousarray(positions), dev), md)
        last = host_to_device(query_start_loc[1:] - 1, dev)
        return argmax_rows(self.model.compute_logits(hidden[last])).cpu().numpy()
