"""InputBatch: per-request state kept in preallocated host arrays across steps.

Each live request owns one row. A step touches only rows that changed (new requests,
appended blocks, sampled tokens); inputs for the forward pass are gathered from these
arrays with vectorized numpy, never per-token Python loops.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.core.contracts import NewRequestData
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sampling_params import SamplingParams


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_blocks_per_req: int,
                 vocab_size: int, device: torch.device) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = device
        # +1: a prompt of max_model_len tokens still samples one token after it.
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        # Pad entries stay 0, the null block.
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.temperature = np.ones(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.full(max_num_reqs, vocab_size, dtype=np.int64)
        self.is_greedy = np.zeros(max_num_reqs, dtype=bool)
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        self.eos_token_ids: list[int | None] = [None] * max_num_reqs
        self.generators: dict[int, torch.Generator] = {}
        self.req_id_to_row: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def add_request(self, new: NewRequestData) -> int:
        row = self._free_rows.pop()
        self.req_id_to_row[new.req_id] = row
        tokens = new.prompt_token_ids + new.output_token_ids
        self.token_ids[row, :len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt_tokens[row] = len(new.prompt_token_ids)
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.num_blocks[row] = 0
        self.append_blocks(row, new.block_ids)
        self._set_sampling(row, new)
        return row

    def _set_sampling(self, row: int, new: NewRequestData) -> None:
        sp = new.sampling_params
        self.params[row] = sp
        self.eos_token_ids[row] = new.eos_token_id
        self.is_greedy[row] = sp.is_greedy
        self.temperature[row] = 1.0 if sp.is_greedy else sp.temperature
        self.top_p[row] = sp.top_p
        self.top_k[row] = sp.top_k if sp.top_k > 0 else self.vocab_size
        if sp.seed is not None and not sp.is_greedy:
            gen = torch.Generator(device=self.device).manual_seed(sp.seed)
            # Resumed after preemption: replay the draws of the tokens already sampled,
            # so a seeded request's output does not depend on being preempted.
            scratch = torch.empty(self.vocab_size, device=self.device)
            for _ in new.output_token_ids:
                scratch.exponential_(generator=gen)
            self.generators[row] = gen

    def remove_request(self, req_id: str) -> None:
        row = self.req_id_to_row.pop(req_id, None)
        if row is None:
            return
        self.params[row] = None
        self.generators.pop(row, None)
        self._free_rows.append(row)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[row])
        self.block_table[row, start:start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def append_sampled(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1

    def sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        """Gather the sampling state of `rows` (the rows that sample, in logits order)."""
        dev = self.device
        is_greedy = self.is_greedy[rows]
        top_p, top_k = self.top_p[rows], self.top_k[rows]
        return SamplingMetadata(
            temperature=torch.from_numpy(self.temperature[rows]).to(dev),
            is_greedy=torch.from_numpy(is_greedy).to(dev),
            all_greedy=bool(is_greedy.all()),
            all_random=not bool(is_greedy.any()),
            top_p=torch.from_numpy(top_p).to(dev) if (top_p < 1).any() else None,
            top_k=torch.from_numpy(top_k).to(dev) if (top_k < self.vocab_size).any() else None,
            generators={i: self.generators[r] for i, r in enumerate(rows.tolist())
                        if r in self.generators},
            banned_token_ids=self._banned(rows),
        )

    def _banned(self, rows: np.ndarray) -> dict[int, list[int]]:
        """EOS and stop ids are masked while a request has fewer than min_tokens outputs."""
        banned: dict[int, list[int]] = {}
        for i, r in enumerate(rows.tolist()):
            sp = self.params[r]
            if sp.min_tokens and self.num_tokens[r] - self.num_prompt_tokens[r] < sp.min_tokens:
                eos = self.eos_token_ids[r]
                ids = list(sp.stop_token_ids)
                if eos is not None and not sp.ignore_eos:
                    ids.append(eos)
                if ids:
                    banned[i] = ids
        return banned
