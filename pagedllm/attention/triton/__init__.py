"""The `triton` attention backend: Triton kernels for CUDA.

- `cache.py`: `reshape_and_cache`, this step's K/V scattered into the paged cache
  (quantized into an fp8 cache).
- `kernels.py`: the varlen paged-attention kernel for mixed prefill/decode batches (with
  a split-KV mode) and the reduce kernel that merges split-KV partitions.
- `ops.py`: typed launch wrappers: tile sizes, grids, the split-KV heuristic.
- `attention.py`: `TritonAttention`, the backend class (registry name "triton").

The same kernels run on CPU tensors under `TRITON_INTERPRET=1` (set before triton is
imported), which is how the tests check them against `torch_ref` without a GPU.
Importing this package imports triton; the backend registry does so only when chosen.
"""
