"""Fixtures shared by the GGUF loader tests."""

from __future__ import annotations

import gguf
import numpy as np
import pytest


@pytest.fixture
def memmapped_readers(monkeypatch) -> list[bool]:
    """One entry per GGUF reader built from here on, ours and transformers': True where it
    is gguf-py's np.memmap reader, False for the plain-ndarray one (`open_reader`'s)."""
    built: list[bool] = []
    real_init = gguf.GGUFReader.__init__

    def spy(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        built.append(isinstance(self.data, np.memmap))

    monkeypatch.setattr(gguf.GGUFReader, "__init__", spy)
    return built
