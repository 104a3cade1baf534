"""load_st_pooling_type: the pooling a sentence-transformers directory declares."""

from __future__ import annotations

import json

import pytest

from pagedllm.loader.st_config import load_st_pooling_type

POOLING = "sentence_transformers.models.Pooling"


def _st_dir(tmp_path, modes: dict[str, bool], pooling_path: str = "1_Pooling"):
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": pooling_path, "type": POOLING},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    (tmp_path / pooling_path).mkdir()
    (tmp_path / pooling_path / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 8, "pooling_mode_cls_token": False,
         "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False, **modes}))
    return str(tmp_path)


@pytest.mark.parametrize("modes,expected", [
    ({"pooling_mode_mean_tokens": True}, "mean"),
    ({"pooling_mode_cls_token": True}, "cls"),
    ({"pooling_mode_lasttoken": True}, "last"),
    ({"pooling_mode_max_tokens": True}, None),  # not implemented: the caller's default
    ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}, None),  # concat
])
def test_pooling_modes(tmp_path, modes, expected):
    assert load_st_pooling_type(_st_dir(tmp_path, modes)) == expected


def test_no_sentence_transformers_config(tmp_path):
    assert load_st_pooling_type(str(tmp_path)) is None  # plain HF directory
    assert load_st_pooling_type(str(tmp_path / "model.gguf")) is None
    (tmp_path / "modules.json").write_text("not json")
    assert load_st_pooling_type(str(tmp_path)) is None
    (tmp_path / "modules.json").write_text(json.dumps([{"type": POOLING, "path": "gone"}]))
    assert load_st_pooling_type(str(tmp_path)) is None
