"""Shared fixtures: tiny seeded HF models built from transformers configs (no downloads)."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Hermetic: converted GGUF weights etc. go to a per-session directory, not ~/.cache.
os.environ.setdefault("PAGEDLLM_CACHE_DIR", tempfile.mkdtemp(prefix="pagedllm-test-cache-"))
# A failed native kernel build fails the suite instead of quietly testing the torch
# fallback; a machine without a C++ compiler says so with PAGEDLLM_CPU_KERNELS=auto.
os.environ.setdefault("PAGEDLLM_CPU_KERNELS", "required")


def _set_triton_interpret() -> None:
    """Without a GPU the Triton kernels run under the interpreter, which must be chosen
    before triton is first imported: its own library functions are decorated then, and
    a kernel of interpreter mode cannot call compiled-mode ones. Here, before any test
    module (some import triton indirectly, through torch's inductor) is collected."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_set_triton_interpret()


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.cuda` tests skip cleanly on a machine without a GPU (CI)."""
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
