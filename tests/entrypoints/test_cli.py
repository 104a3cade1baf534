"""The CLI: serve / generate / chat share the EngineArgs flags; `chat` reads stdin."""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import socket
import subprocess
import sys

import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.cli import build_parser, engine_args_from, main, serve_config_from


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


@pytest.mark.parametrize("command", ["serve", "generate", "chat"])
def test_engine_flags_shared_and_documented(command):
    sub = _subparser(command)
    by_dest = {a.dest: a for a in sub._actions}
    for f in dataclasses.fields(EngineArgs):
        assert f.name in by_dest, f"{command} lacks --{f.name}"
        assert by_dest[f.name].help, f"--{f.name} has no help"
    text = sub.format_help()
    assert "--max-num-seqs" in text and "--kv-cache-space" in text


def test_serve_arguments():
    ns = build_parser().parse_args(["serve", "/models/qwen2", "--port", "8001",
                                    "--max-num-seqs", "64", "--api-key", "secret"])
    args = engine_args_from(ns)
    assert args.model == "/models/qwen2" and args.max_num_seqs == 64
    assert (ns.port, ns.api_key, ns.host) == (8001, "secret", "127.0.0.1")
    default = build_parser().parse_args(["serve"])
    assert engine_args_from(default).model is None and default.port == 8000
    # vLLM's spellings of options pagedllm takes.
    ns = build_parser().parse_args(["serve", "--runner", "pooling", "--task", "embed",
                                    "--tokenizer-mode", "hf", "--enable-log-requests",
                                    "--enable-log-outputs", "--max-log-len", "100",
                                    "--enable-responses-store", "--load-format", "dummy",
                                    "--chat-template-content-format", "openai",
                                    "--response-role", "bot",
                                    "--max-background-responses", "3"])
    args = engine_args_from(ns)
    assert (args.runner, args.task, args.tokenizer_mode) == ("pooling", "embed", "hf")
    assert args.load_format == "dummy"
    config = serve_config_from(ns)
    assert config.enable_log_requests and config.enable_log_outputs
    assert config.max_log_len == 100 and config.enable_responses_store
    assert (config.chat_template_content_format, config.response_role,
            config.max_background_responses) == ("openai", "bot", 3)
    # This stop's: vLLM's short forms, and the options they name.
    ns = build_parser().parse_args(["serve", "-tp", "2", "-pp", "3", "-dp", "4",
                                    "--enable-sleep-mode", "--profiler-dir", "/tmp/t",
                                    "--logits-processors", "a.b:C", "d.e.F"])
    args = engine_args_from(ns)
    assert (args.tensor_parallel_size, args.pipeline_parallel_size,
            args.data_parallel_size) == (2, 3, 4)
    assert args.enable_sleep_mode and args.profiler_dir == "/tmp/t"
    assert args.logits_processors == ["a.b:C", "d.e.F"]


def test_json_object_flag(capsys):
    ns = build_parser().parse_args(
        ["generate", "--speculative-config",
         '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert engine_args_from(ns).speculative_config == {"method": "ngram",
                                                       "num_speculative_tokens": 3}
    for bad in ("{not json", "[1, 2]"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["generate", "--speculative-config", bad])
    assert "expected a JSON object" in capsys.readouterr().err


def test_chat_reads_stdin_lines():
    from pagedllm.entrypoints.chat import run_chat

    # Dequantized float32: its first answer token, "The" (... Paris), leads by 0.08 nats
    # only; bfloat16 or the native quantized path's int8 activations open with "L'".
    ns = build_parser().parse_args(["chat", "--dtype", "float32", "--temperature", "0",
                                    "--max-tokens", "12", "--num-kv-blocks", "64",
                                    "--max-model-len", "512", "--dequantize"])
    stdin = io.StringIO("What is the capital of France?\n\n/reset\n/exit\nignored\n")
    stdout = io.StringIO()
    assert run_chat(engine_args_from(ns), ns, stdin=stdin, stdout=stdout) == 0
    lines = stdout.getvalue().splitlines()
    assert "Paris" in stdout.getvalue()
    assert "[conversation cleared]" in lines
    assert "ignored" not in stdout.getvalue()


@pytest.mark.parametrize("argv, message", [
    (["generate", "--max-model-len", "-5"], "max_model_len must be >= 1, got -5"),
    (["generate", "--model", "/nonexistent"], "model path does not exist: '/nonexistent'"),
    (["serve", "--port", "0", "--lora-modules", "x"], "--lora-modules 'x': expected name=path"),
])
def test_options_that_cannot_run_get_one_line_and_code_2(argv, message, capsys):
    """One argparse-style line naming what is wrong, not a traceback through the
    start-up code."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pagedllm {argv[0]}: error: ") and err.count("\n") == 1
    assert message in err


def test_serve_on_a_port_in_use_fails_before_loading_the_model():
    """The socket is bound first: the port's failure comes in seconds, not after the
    model's load (minutes for a big one)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(port)],
            capture_output=True, text=True, timeout=120,
            env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert result.returncode == 2, result.stderr
    assert (f"pagedllm serve: error: cannot listen on 127.0.0.1:{port}: Address already "
            f"in use") in result.stderr
    assert "engine core" not in result.stderr and "Traceback" not in result.stderr


def _broken_model(path) -> str:
    """A tiny Llama with a tokenizer whose weights file is cut in half."""
    from tests.utils import save_tiny_model, tiny_llama_config, word_tokenizer

    save_tiny_model(path, tiny_llama_config(vocab_size=256))
    word_tokenizer([f"w{i}" for i in range(200)]).save_pretrained(path)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return str(path)


@pytest.mark.parametrize("case", ["broken weights", "kv cache past memory"])
def test_serve_reports_what_the_engine_could_not_load_in_one_line(case, tmp_path):
    """The engine process fails on the model or on an option only it can check (its
    weights, its KV cache's size): the server prints that error as one line, code 2.
    It printed the engine's traceback, then its own (74 lines; a KV cache past memory:
    a bare "OSError: [Errno 12] Cannot allocate memory")."""
    if case == "broken weights":
        args = ["--model", _broken_model(tmp_path / "broken")]
        message = "cannot open safetensors file"
    else:
        args = ["--num-kv-blocks", "100000000"]
        message = "is larger than this machine's memory"
    result = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", "0", *args],
        capture_output=True, text=True, timeout=120,
        env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines()
              if not line.startswith("INFO ") and not line.startswith("WARNING ")]
    assert len(errors) == 1 and errors[0].startswith("pagedllm serve: error: "), errors
    assert message in errors[0]
    assert "--num-kv-blocks" in errors[0] or case == "broken weights"


def test_serve_listens_on_every_address_of_its_host():
    """As asyncio's create_server bound them when uvicorn did: "" is every interface (of
    both families where the machine has IPv6), an IPv4 literal one socket."""
    from pagedllm.entrypoints.openai.server import listen_sockets

    everywhere = listen_sockets("", 0)
    one = listen_sockets("127.0.0.1", 0)
    try:
        assert socket.AF_INET in {s.family for s in everywhere}
        assert [s.getsockname()[0] for s in one] == ["127.0.0.1"]
    finally:
        for s in everywhere + one:
            s.close()
