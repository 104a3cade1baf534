"""Tensor-parallel process groups (`parallel_state.py`) and the communication ops the
sharded layers call (`comm.py`). Pipeline parallelism is not built yet."""
