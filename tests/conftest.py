"""Shared fixtures: tiny seeded HF models built from transformers configs (no downloads)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _private_cache_dir() -> None:
    """Hermetic: the native kernel build, converted GGUF weights etc. go to a per-session
    directory, not ~/.cache. It holds about 1 GB, so it goes when the session ends: left
    behind, a few hundred runs filled the disk that CI's own run then needed."""
    if "PAGEDLLM_CACHE_DIR" in os.environ:
        return
    path = tempfile.mkdtemp(prefix="pagedllm-test-cache-")
    os.environ["PAGEDLLM_CACHE_DIR"] = path
    owner = os.getpid()

    def remove() -> None:
        if os.getpid() == owner:  # a forked worker inherits the hook; only this process cleans
            shutil.rmtree(path, ignore_errors=True)

    atexit.register(remove)


_private_cache_dir()
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
