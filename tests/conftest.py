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
