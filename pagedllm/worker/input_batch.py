"""InputBatch: per-request state kept in preallocated host arrays across steps.

Each live request owns one row. A step touches only rows that changed (new requests,
appended blocks, sampled tokens); inputs for the forward pass are gathered from these
arrays with vectorized numpy, never per-token Python loops.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pagedllm.core.contracts import NewRequestData
from pagedllm.lora_request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.worker.sampling_state import SamplingState


class InputBatch:
    """One row per live request, kept across steps.

    Rows come from a free list (the most recently freed row is taken first) and are never
    condensed: a request keeps its row until it finishes or is preempted, so a step's rows
    are in no particular order and the runner gathers them by `req_id_to_row`.
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_blocks_per_req: int,
                 vocab_size: int, device: torch.device, num_kv_groups: int = 1,
                 logits_processors: tuple[Any, ...] = ()) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = device
        # +1: a prompt of max_model_len tokens still samples one token after it.
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        # Per KV cache group (core/kv_groups.py) and row; pad entries stay 0, the null block.
        self.block_tables = np.zeros((num_kv_groups, max_num_reqs, max_num_blocks_per_req),
                                     dtype=np.int32)
        self.num_blocks = np.zeros((num_kv_groups, max_num_reqs), dtype=np.int64)
        # Sampling parameters per row (scalars in arrays, extras in dicts).
        self.sampling = SamplingState(max_num_reqs, vocab_size, device, self.token_ids,
                                      self.num_tokens, self.num_prompt_tokens,
                                      logits_processors)
        # Embedding rows (pooled, never sampled) and their pooling, by req_id.
        self.is_pooling = np.zeros(max_num_reqs, dtype=bool)
        self.pooling_params: dict[str, PoolingParams] = {}
        # Each row's LoRA adapter id (0: none), and the adapters of the rows with one.
        self.lora_ids = np.zeros(max_num_reqs, dtype=np.int64)
        self.loras: dict[int, LoRARequest] = {}
        self.req_id_to_row: dict[str, int] = {}
        # Bumped when a row is taken or freed: work launched for a row's request
        # (a deferred sample) checks that the row still holds it.
        self.generation = np.zeros(max_num_reqs, dtype=np.int64)
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def add_request(self, new: NewRequestData) -> int:
        row = self._free_rows.pop()
        self.req_id_to_row[new.req_id] = row
        self.generation[row] += 1
        tokens = new.prompt_token_ids + new.output_token_ids
        self.token_ids[row, :len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt_tokens[row] = len(new.prompt_token_ids)
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.num_blocks[:, row] = 0
        self.append_blocks(row, new.block_ids)
        self.sampling.add(row, new)
        self.is_pooling[row] = new.pooling_params is not None
        self.lora_ids[row] = 0
        if new.lora_request is not None:
            self.lora_ids[row] = new.lora_request.lora_int_id
            self.loras[row] = new.lora_request
        if new.pooling_params is not None:
            self.pooling_params[new.req_id] = new.pooling_params
        return row

    def remove_request(self, req_id: str, preempted: bool = False) -> None:
        """Free the request's row; a `preempted` one will be added again (its seeded
        generator's state is kept for then)."""
        row = self.req_id_to_row.pop(req_id, None)
        if not preempted:
            self.sampling.forget(req_id)
        if row is None:
            return
        if preempted:
            self.sampling.save_generator(row, req_id)
        self.generation[row] += 1
        self.sampling.remove(row)
        self.is_pooling[row] = False
        self.lora_ids[row] = 0
        self.loras.pop(row, None)
        self.pooling_params.pop(req_id, None)
        # A reused row must pad with the null block again, not with this request's blocks.
        for table, num_blocks in zip(self.block_tables, self.num_blocks):
            table[row, :num_blocks[row]] = 0
        self.num_blocks[:, row] = 0
        self._free_rows.append(row)

    def append_blocks(self, row: int, block_ids: list[list[int]]) -> None:
        """Append each group's new block ids to the row's table of that group."""
        for table, num_blocks, ids in zip(self.block_tables, self.num_blocks, block_ids,
                                          strict=True):
            start = int(num_blocks[row])
            table[row, start:start + len(ids)] = ids
            num_blocks[row] = start + len(ids)

    def append_sampled(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1

    def sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        """Gather the sampling state of `rows` (the rows that sample, in logits order)."""
        return self.sampling.metadata(rows)
