"""vLLM options that select what pagedllm always does: --config-format hf, --model-impl
vllm (its own implementations) and the deprecated --disable-cascade-attn are taken;
the choices it does not have are refused by name."""

from __future__ import annotations

import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.cli import build_parser, engine_args_from
from pagedllm.errors import ConfigError
from tests.utils import save_tiny_model, tiny_llama_config


def test_taken_and_refused(tmp_path):
    path = str(save_tiny_model(tmp_path, tiny_llama_config()))
    args = engine_args_from(build_parser().parse_args(
        ["serve", path, "--config-format", "hf", "--model-impl", "vllm",
         "--disable-cascade-attn"]))
    assert (args.config_format, args.model_impl, args.disable_cascade_attn) == (
        "hf", "vllm", True)
    assert args.create_engine_config().model.path == path
    for kw, match in [({"model_impl": "transformers"}, "model_impl must be one of"),
                      ({"config_format": "mistral"}, "config_format must be one of")]:
        with pytest.raises(ConfigError, match=match):
            EngineArgs(model=path, **kw).create_engine_config()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", path, "--model-impl", "terratorch"])
