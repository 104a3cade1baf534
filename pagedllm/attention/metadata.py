"""Per-step attention metadata shared by every attention layer of one forward pass."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """Where each scheduled token's K/V goes and what context each request reads.

    Tokens are flattened request by request: request i owns query rows
    `[query_start_loc[i], query_start_loc[i+1])`, whose absolute positions are
    `seq_lens[i] - query_len_i .. seq_lens[i] - 1` (prefill chunks and decodes alike).
    """

    num_reqs: int
    num_actual_tokens: int
    # [num_reqs + 1] int32: prefix sums of query lengths.
    query_start_loc: torch.Tensor
    # [num_reqs] int32: context length after this step (cached + scheduled tokens).
    seq_lens: torch.Tensor
    # [num_reqs, max_num_blocks] int32: physical block ids; pad entries point at block 0.
    block_table: torch.Tensor
    # [num_tokens] int64: cache slot of each token = block_id * block_size + pos % block_size.
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    # Host copies of the two small arrays, so backends loop over requests without a sync.
    query_start_loc_cpu: np.ndarray
    seq_lens_cpu: np.ndarray
    # Captured in a CUDA graph (worker/cuda_graphs.py): the tensors are static buffers
    # refilled before each replay, so a backend must not choose kernels or grids from
    # per-step host values (max_seq_len is then only an upper bound, the host arrays
    # those of the capture).
    static_shapes: bool = False
    # With KV cache groups (sliding-window layers, core/kv_groups.py): per group, this
    # metadata with the group's block_table and slot_mapping (entry 0 is self); empty
    # for a model with one group.
    groups: tuple[AttentionMetadata, ...] = field(default=(), repr=False)
    # Not attention's but the step's, read by the native decoder stack: bool [T], the
    # tokens that are prompt tokens of their request, where the quantized GEMM runs
    # those on other kernels (worker/prompt_rows.py); None: every row alike.
    prompt_rows: torch.Tensor | None = None

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata an attention layer of KV cache group `group` reads."""
        return self.groups[group] if self.groups else self

    @classmethod
    def from_host(cls, query_start_loc: np.ndarray, seq_lens: np.ndarray,
                  block_table: np.ndarray, slot_mapping: np.ndarray,
                  device: torch.device) -> AttentionMetadata:
        """The metadata of a step built on the host (numpy; the runner's and the draft
        proposer's), its tensors copied to `device`."""
        return cls(
            num_reqs=len(seq_lens), num_actual_tokens=int(query_start_loc[-1]),
            query_start_loc=host_to_device(query_start_loc, device, torch.int32),
            seq_lens=host_to_device(seq_lens, device, torch.int32),
            block_table=host_to_device(block_table, device),
            slot_mapping=host_to_device(slot_mapping, device),
            max_query_len=int(np.diff(query_start_loc).max()), max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=query_start_loc, seq_lens_cpu=seq_lens)


def host_to_device(array: np.ndarray, device: torch.device,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """`array` as a tensor on `device` (converted to `dtype` on the host first).

    To a GPU through pinned (page-locked) memory with a non-blocking copy: the host goes
    on preparing the step while the copy runs, in stream order before the kernels that
    read it. (pin_memory() draws from torch's caching host allocator, which keeps a
    buffer until the copies queued from it have run.)
    """
    tensor = torch.from_numpy(array)
    if dtype is not None:
        tensor = tensor.to(dtype)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
