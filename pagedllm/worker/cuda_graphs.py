"""CUDA graphs of decode-only steps: one captured forward per batch-size bucket.

A decode step of a small model is mostly launch overhead: hundreds of small kernels,
each launched from Python. Captured once per bucket at start-up, a step replays the
whole forward with one launch. A graph replays fixed kernels on fixed addresses, so
the step's inputs go into static buffers first, the batch padded to its bucket:

- padding rows decode token 0 at position 0 with a one-token context; their K/V go to
  slot 0 of the null block (block 0, never handed out) and their block-table rows
  point at it, so they touch no request's cache; their outputs are dropped;
- the captured AttentionMetadata is marked `static_shapes`: backends pick launch
  shapes that hold for any step of the bucket (the Triton backend: no split-KV, whose
  partition count depends on the step's longest context).

Only decode-only steps (one token per request) replay; prefill chunks, speculative
verification (several tokens per request) and batches above the largest bucket run
eagerly. `capture` is the seam that makes the padding and buffer logic testable
without a GPU: `eager_capture` re-runs the forward on the static buffers at "replay".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

# forward(input_ids, positions, attn_metadata) -> hidden states [T, hidden]
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
# capture(run) -> (replay, output): `run` computes the output from the static buffers;
# `replay()` recomputes it in place (in `output`).
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


def graph_buckets(max_num_seqs: int, sizes: Sequence[int] | None = None,
                  max_size: int | None = None) -> list[int]:
    """Batch sizes that get a graph: `sizes` (vLLM's cudagraph_capture_sizes), or 1, 2,
    4, 8, then steps of 8 up to `max_size` (vLLM's sizes; default max_num_seqs); none
    past max_num_seqs. A batch runs in the smallest bucket that holds it, eagerly past
    the largest."""
    top = max_num_seqs if max_size is None else min(max_size, max_num_seqs)
    if sizes is None:
        sizes = [b for b in (1, 2, 4) if b < top]
        sizes += range(8, top + 8, 8)
    return sorted({min(b, top) for b in sizes})


class CudaGraphCapture:
    """Captures with torch.cuda.CUDAGraph into one memory pool shared by every bucket
    (captured largest first, so smaller graphs reuse its blocks)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, run: Callable[[], torch.Tensor],
                 ) -> tuple[Callable[[], None], torch.Tensor]:
        # Warm-up outside the graph: Triton compiles its kernels on first launch and
        # cuBLAS picks algorithms; neither may happen during capture.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = run()
        return graph.replay, output


def eager_capture(run: Callable[[], torch.Tensor],
                  ) -> tuple[Callable[[], None], torch.Tensor]:
    """A stand-in for capture without a GPU: "replay" re-runs the forward on the static
    buffers and writes its output where a graph's would be."""
    output = run()

    def replay() -> None:
        output.copy_(run())

    return replay, output


class DecodeGraphs:
    """Static input buffers and one captured forward per bucket.

    A step's inputs go from numpy into pinned host copies of the static buffers, padded
    there, then to the device in one non-blocking copy per buffer (`stage`). The next
    `stage` rewrites the host buffers only once those copies have run (an event after
    them): under async scheduling the step that queued them may still be waiting on
    the device.
    """

    def __init__(self, forward: Forward, max_num_seqs: int, max_blocks_per_req: int,
                 num_groups: int, max_model_len: int, device: torch.device,
                 capture: Capture, sizes: Sequence[int] | None = None,
                 max_size: int | None = None) -> None:
        """`sizes`, `max_size`: the batch sizes captured (`graph_buckets`)."""
        self.buckets = graph_buckets(max_num_seqs, sizes, max_size)
        self.max_model_len = max_model_len
        n = self.buckets[-1]
        # name -> (host, device) buffer pairs; rows are requests, padding included.
        shapes = {"input_ids": ((n,), torch.int64), "positions": ((n,), torch.int64),
                  "seq_lens": ((n,), torch.int32),
                  "block_tables": ((num_groups, n, max_blocks_per_req), torch.int32),
                  "slot_mappings": ((num_groups, n), torch.int64)}
        pin = device.type == "cuda"
        self.host = {k: torch.zeros(shape, dtype=dtype, pin_memory=pin)
                     for k, (shape, dtype) in shapes.items()}
        self.dev = {k: torch.zeros(shape, dtype=dtype, device=device)
                    for k, (shape, dtype) in shapes.items()}
        self.host_np = {k: t.numpy() for k, t in self.host.items()}
        # Recorded after the last stage's copies (CUDA only).
        self._copied: torch.cuda.Event | None = None
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self._replay: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        start = time.perf_counter()
        for bucket in reversed(self.buckets):
            run = _bound(forward, self.dev["input_ids"][:bucket],
                         self.dev["positions"][:bucket], self._metadata(bucket))
            self._replay[bucket] = capture(run)
        logger.info("captured CUDA graphs of decode steps for %d batch sizes (%d..%d) in "
                    "%.1f s", len(self.buckets), self.buckets[0], n,
                    time.perf_counter() - start)

    def _metadata(self, bucket: int) -> AttentionMetadata:
        """The metadata every replay of `bucket` reads: views of the static buffers."""
        return self._views(bucket, self.dev["block_tables"].shape[2], self.max_model_len,
                           np.arange(bucket + 1, dtype=np.int64),
                           np.full(bucket, self.max_model_len, dtype=np.int64),
                           static_shapes=True)

    def _views(self, n: int, width: int, max_seq_len: int, query_start_loc: np.ndarray,
               seq_lens: np.ndarray, static_shapes: bool) -> AttentionMetadata:
        """Metadata of n one-token requests over the static buffers' first n rows (block
        tables `width` wide), one per KV cache group (entry 0 is the result itself)."""
        dev = self.dev
        groups = [AttentionMetadata(
            num_reqs=n, num_actual_tokens=n, query_start_loc=self.query_start_loc[:n + 1],
            seq_lens=dev["seq_lens"][:n], block_table=dev["block_tables"][g, :n, :width],
            slot_mapping=dev["slot_mappings"][g, :n], max_query_len=1,
            max_seq_len=max_seq_len, query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens, static_shapes=static_shapes)
            for g in range(len(dev["block_tables"]))]
        md = groups[0]
        if len(groups) > 1:
            md.groups = tuple(groups)
        return md

    def bucket_for(self, num_reqs: int, max_query_len: int) -> int | None:
        """The bucket a step replays in, or None when it must run eagerly."""
        if max_query_len != 1 or num_reqs > self.buckets[-1]:
            return None
        return next(b for b in self.buckets if b >= num_reqs)

    def stage(self, bucket: int, input_ids: np.ndarray, positions: np.ndarray,
              query_start_loc: np.ndarray, seq_lens: np.ndarray,
              tables: list[tuple[np.ndarray, np.ndarray]],
              ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Put a decode step (one token per request) in `bucket`'s static buffers; its
        input_ids, positions and metadata as views of them (the step's own sizes and
        host arrays, for everything but the forward pass, which `replay` runs)."""
        n, host = len(seq_lens), self.host_np
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies have read the buffers
        # Padding rows: see the module docstring.
        host["input_ids"][:n] = input_ids
        host["input_ids"][n:bucket] = 0
        host["positions"][:n] = positions
        host["positions"][n:bucket] = 0
        host["seq_lens"][:n] = seq_lens
        host["seq_lens"][n:bucket] = 1
        for g, (table, slots) in enumerate(tables):
            # Columns past the step's width hold older steps' ids: never read, as they
            # lie past every context (seq_lens) of this step.
            host["block_tables"][g, :n, :table.shape[1]] = table
            host["block_tables"][g, n:bucket] = 0
            host["slot_mappings"][g, :n] = slots
            host["slot_mappings"][g, n:bucket] = 0
        for key, dst in self.dev.items():
            src = self.host[key]
            if dst.dim() == 1:
                dst[:bucket].copy_(src[:bucket], non_blocking=True)
            else:  # per group: its first `bucket` rows are contiguous
                for g in range(dst.shape[0]):
                    dst[g, :bucket].copy_(src[g, :bucket], non_blocking=True)
        if self.query_start_loc.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        # Every group's table has the step's width (the runner cuts them alike).
        md = self._views(n, tables[0][0].shape[1], int(seq_lens.max()), query_start_loc,
                         seq_lens, static_shapes=False)
        return self.dev["input_ids"][:n], self.dev["positions"][:n], md

    def replay(self, bucket: int, num_reqs: int) -> torch.Tensor:
        """Run `bucket`'s graph on what `stage` put in; hidden states [num_reqs, hidden]."""
        replay, output = self._replay[bucket]
        replay()
        return output[:num_reqs]

def _bound(forward: Forward, input_ids: torch.Tensor, positions: torch.Tensor,
           md: AttentionMetadata) -> Callable[[], torch.Tensor]:
    return lambda: forward(input_ids, positions, md)
