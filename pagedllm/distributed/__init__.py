"""Process groups of tensor and pipeline parallelism (`parallel_state.py`) and the
communication ops the sharded layers and the model runner call (`comm.py`)."""
