"""max_model_len against the model's trained positions (engine/arg_utils.py)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from pagedllm.engine.arg_utils import _resolve_max_model_len
from pagedllm.errors import ConfigError


def test_rotary_models_may_go_past_their_positions_with_a_warning(caplog):
    config = SimpleNamespace(model_type="llama", max_position_embeddings=128)
    assert _resolve_max_model_len(None, config) == 128
    with caplog.at_level(logging.WARNING):
        assert _resolve_max_model_len(128, config) == 128
    assert not caplog.records
    with caplog.at_level(logging.WARNING):
        assert _resolve_max_model_len(1000, config) == 1000
    assert "greater than the 128 positions this model was trained on" in caplog.text


def test_the_default_is_capped_and_nonsense_refused():
    assert _resolve_max_model_len(None, SimpleNamespace(model_type="llama",
                                                        max_position_embeddings=131072)) == 8192
    with pytest.raises(ConfigError, match="max_model_len must be >= 1"):
        _resolve_max_model_len(0, SimpleNamespace(model_type="llama"))
