"""vLLM's -O and --compilation-config (-cc), and the dotted form of JSON flags
(engine/compilation.py, entrypoints/dotted_flags.py): what they turn into here (eager or
CUDA graphs of decode steps, and which batch sizes), and what is refused. The graphs of
those sizes: tests/worker/test_decode_graphs.py."""

from __future__ import annotations

import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.compilation import resolve_graphs
from pagedllm.entrypoints.cli import build_parser, engine_args_from
from pagedllm.entrypoints.dotted_flags import expand_dotted_flags, json_object_flags
from pagedllm.errors import ConfigError


def _device(*argv: str):
    args = expand_dotted_flags(["serve", *argv], json_object_flags(EngineArgs))
    return engine_args_from(build_parser().parse_args(args)).create_engine_config().device


def _graphs(device) -> tuple:
    return device.enforce_eager, device.cuda_graph_sizes, device.max_cuda_graph_size


def test_optimization_levels():
    assert _graphs(_device()) == (False, None, None)
    assert _graphs(_device("-O0")) == (True, None, None)
    for argv in (["-O3"], ["-O", "1"], ["--optimization-level", "2"]):
        assert _graphs(_device(*argv)) == (False, None, None)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "-O4"])
    with pytest.raises(ConfigError, match="-O0 .* contradict"):
        resolve_graphs(False, True, 0, None)


def test_compilation_config_keys_that_mean_something_here():
    assert _graphs(_device("-cc", '{"cudagraph_capture_sizes": [8, 1, 4, 4]}')) \
        == (False, (1, 4, 8), None)
    assert _graphs(_device("--compilation-config", '{"max_cudagraph_capture_size": 16}')) \
        == (False, None, 16)
    # Sizes past the cap are dropped; none left, or a cap of 0, is no graphs (vLLM's).
    assert _graphs(_device("-cc", '{"cudagraph_capture_sizes": [1, 32], '
                                  '"max_cudagraph_capture_size": 16}')) == (False, (1,), 16)
    assert _graphs(_device("-cc", '{"cudagraph_capture_sizes": []}'))[0]
    assert _graphs(_device("-cc", '{"max_cudagraph_capture_size": 0}'))[0]
    for mode in ("NONE", "none"):
        assert _graphs(_device("-cc", f'{{"cudagraph_mode": "{mode}"}}'))[0]
    for mode in ("FULL_DECODE_ONLY", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE"):
        assert not _graphs(_device("-cc", f'{{"cudagraph_mode": "{mode}"}}'))[0]
    # --enforce-eager wins over sizes (vLLM's).
    assert _graphs(_device("--enforce-eager", "-cc", '{"cudagraph_capture_sizes": [2]}')) \
        == (True, None, None)
    # Modes: 0 is no compile (with --compile a contradiction), 1-3 keep the defaults;
    # vLLM's older `level` and bare number; its compiler's tuning keys change nothing.
    assert _graphs(_device("-cc", '{"mode": "VLLM_COMPILE", "pass_config": {"x": 1}, '
                                  '"custom_ops": ["none"], "backend": "inductor"}')) \
        == (False, None, None)
    assert resolve_graphs(False, False, None, {"level": 3}).enforce_eager is False
    assert resolve_graphs(False, False, None, 0).enforce_eager is False


def test_vllms_shortcut_flags():
    assert _graphs(_device("--cudagraph-capture-sizes", "4", "1", "2")) \
        == (False, (1, 2, 4), None)
    assert _graphs(_device("--max-cudagraph-capture-size", "24")) == (False, None, 24)
    assert _graphs(_device("--max-cudagraph-capture-size", "0"))[0]
    with pytest.raises(ConfigError, match="mutually exclusive"):
        _device("--cudagraph-capture-sizes", "1", "-cc", '{"cudagraph_capture_sizes": [2]}')
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--cudagraph-capture-sizes", "one"])


@pytest.mark.parametrize("cc, match", [
    ({"mode": 0}, "mode 0 .* contradict"),
    ({"mode": 4}, "mode must be 0-3"), ({"mode": "fast"}, "mode must be"),
    ({"mode": True}, "mode must be"), ({"mode": 1, "level": 1}, "not both"),
    ({"cudagraph_mode": "SOMETIMES"}, "cudagraph_mode must be one of"),
    ({"cudagraph_mode": 2}, "cudagraph_mode must be"),
    ({"cudagraph_capture_sizes": [1, 0]}, "list of batch sizes >= 1"),
    ({"cudagraph_capture_sizes": "1,2"}, "list of batch sizes"),
    ({"cudagraph_capture_sizes": [1.5]}, "list of batch sizes"),
    ({"max_cudagraph_capture_size": -1}, "integer >= 0"),
    ({"max_cudagraph_capture_size": "8"}, "integer >= 0"),
    ({"turbo": True}, r"unknown compilation_config keys \['turbo'\]"),
    ("fast", "must be a JSON object"),
])
def test_what_is_refused(cc, match):
    with pytest.raises(ConfigError, match=match):
        resolve_graphs(False, True, None, cc)


def test_dotted_flags_merge_into_one_object():
    flags = json_object_flags(EngineArgs)
    assert flags["-cc"] == "--compilation-config"
    argv = ["serve", "m", "-cc.mode=none", "--max-model-len", "512",
            "--compilation-config.cudagraph_capture_sizes", "[1,2]",
            "--compilation-config", '{"pass_config": {"a": 1}, "mode": 3}',
            "--compilation-config.pass_config.b=true", "--speculative-config.method=ngram",
            "--speculative-config.num_speculative_tokens", "3"]
    assert expand_dotted_flags(argv, flags) == [
        "serve", "m", "--compilation-config",
        '{"mode": 3, "cudagraph_capture_sizes": [1, 2], "pass_config": {"a": 1, "b": true}}',
        "--max-model-len", "512",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    # Untouched: other flags (dots in values too), a whole object that is not JSON
    # (argparse reports it), a dotted flag with no value.
    plain = ["serve", "--model=/m/a.b", "--served-model-name", "x.y", "--chat-template",
             "t.jinja"]
    assert expand_dotted_flags(plain, flags) == plain
    assert expand_dotted_flags(["serve", "-cc", "{oops"], flags) == [
        "serve", "--compilation-config", "{oops"]
    assert expand_dotted_flags(["serve", "-cc.mode"], flags) == ["serve", "-cc.mode"]
    ns = build_parser().parse_args(expand_dotted_flags(
        ["serve", "--speculative-config.method", "ngram",
         "--speculative-config.num_speculative_tokens=2"], flags))
    assert ns.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
