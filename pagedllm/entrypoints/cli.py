"""`pagedllm` command line: serve, chat, generate, models (bench plugs in here).

Engine flags are derived from the EngineArgs dataclass, one per field, so every
subcommand that starts an engine shares them and --help documents each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from typing import Any

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.dotted_flags import expand_dotted_flags, json_object_flags
from pagedllm.errors import ConfigError, ModelLoadError


def add_engine_args(parser: argparse.ArgumentParser, positional_model: bool = False) -> None:
    """One --flag per EngineArgs field (bools get --x / --no-x)."""
    add_dataclass_args(parser.add_argument_group("engine options"), EngineArgs,
                       parser if positional_model else None)


def add_dataclass_args(group: Any, cls: type,
                       positional_model: argparse.ArgumentParser | None = None) -> None:
    """One --flag per field of dataclass `cls`, help from the field's metadata; with
    `positional_model` (the parser) the `model` field is also an optional positional."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        default = (f.default_factory() if f.default is dataclasses.MISSING  # type: ignore[misc]
                   else f.default)
        if "default" not in help_text and default is not None:
            help_text += " (default: %(default)s)"
        kw: dict[str, Any] = {"default": default, "help": help_text, "dest": f.name}
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        hint = hints[f.name]
        if "nargs" in f.metadata:  # a list given as words: --flag a b (its items' type)
            kw["nargs"], kw["type"] = f.metadata["nargs"], _item_type(hint)
        elif hint is bool or hint == (bool | None):
            # bool | None: --flag / --no-flag, or neither (None: decided later).
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = _scalar_type(hint)
        if f.name == "model" and positional_model is not None:
            positional_model.add_argument("model_pos", nargs="?", metavar="MODEL",
                                          default=None, help=kw["help"])
        # vLLM's short forms (-tp 2) where it has them.
        group.add_argument(flag, *f.metadata.get("aliases", ()), **kw)


def _scalar_type(hint: Any) -> Any:
    # X | None is X; list[str] stays list[str] (its args are its items' type).
    is_union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    args = [a for a in typing.get_args(hint) if a is not type(None)] if is_union else [hint]
    if typing.get_origin(args[0]) is dict or args[0] is dict:
        return _json_object
    if typing.get_origin(args[0]) is list:
        return _json_list
    return args[0]


def _item_type(hint: Any) -> Any:
    """list[X] | None -> X where X is int or float; str otherwise."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    items = typing.get_args(hint)
    return items[0] if items and items[0] in (int, float) else str


def _json_list(text: str) -> list[Any]:
    """A flag whose value is a JSON list of strings (e.g. --allowed-origins)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from e
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    """A flag whose value is a JSON object (e.g. --speculative-config)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_model_serving_args(parser: argparse.ArgumentParser) -> None:
    """The flags of how the API serves the model (`serve` and `run-batch`)."""
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) clients use (default: the model argument)")
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                        help="LoRA adapters (PEFT directories) clients select by giving "
                             "NAME as `model`: name=path or a JSON object {\"name\": ..., "
                             "\"path\": ...} each (needs --enable-lora)")
    parser.add_argument("--log-stats-interval", type=float, default=5.0,
                        help="seconds between throughput log lines while busy (0: off)")
    parser.add_argument("--disable-log-stats", dest="log_stats_interval",
                        action="store_const", const=0.0,
                        help="no throughput log lines (--log-stats-interval 0; vLLM's flag)")
    from pagedllm.entrypoints.openai.serve_config import ServeConfig

    add_dataclass_args(parser.add_argument_group("request limits and policies"),
                       ServeConfig)
    parser.add_argument("--disable-log-requests", dest="enable_log_requests",
                        action="store_false", default=False,
                        help="no per-request log lines: the default (vLLM's older flag; "
                             "--enable-log-requests turns them on)")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The `serve` flags beyond the engine's."""
    add_model_serving_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--uds", default=None, metavar="PATH",
                        help="listen on this Unix domain socket instead of --host and "
                             "--port (a socket file left by an earlier server is replaced)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every route but /health "
                             "(default: env PAGEDLLM_API_KEY, which `ps` does not show)")
    parser.add_argument("--root-path", default=None,
                        help="the path prefix a proxy serves the API under (FastAPI's "
                             "root_path)")
    parser.add_argument("--ssl-keyfile", default=None, help="TLS: the key file (PEM)")
    parser.add_argument("--ssl-certfile", default=None,
                        help="TLS: the certificate file (PEM); with --ssl-keyfile the "
                             "server speaks HTTPS")
    parser.add_argument("--ssl-ca-certs", default=None,
                        help="TLS: CA certificates to verify clients with")
    parser.add_argument("--ssl-cert-reqs", type=int, default=0,
                        help="TLS: client certificates (0 none, 1 optional, 2 required; "
                             "Python's ssl.CERT_*)")
    parser.add_argument("--ssl-ciphers", default=None,
                        help="TLS: the cipher suites (TLS 1.2 and below; OpenSSL's "
                             "cipher list format; default: uvicorn's)")
    parser.add_argument("--middleware", action="append", default=[], metavar="IMPORT.PATH",
                        help="an ASGI middleware to add, as vLLM's: a class (added with "
                             "app.add_middleware) or an async function (request, "
                             "call_next) (added as an HTTP middleware), by import path "
                             "(package.module:name or package.module.name); repeatable, "
                             "the last given outermost")
    parser.add_argument("--enable-uvicorn-access-log", dest="uvicorn_access_log",
                        action="store_true", default=False,
                        help="log a line per HTTP request (uvicorn's access log, at INFO "
                             "whatever --uvicorn-log-level); off by default")
    parser.add_argument("--disable-uvicorn-access-log", dest="uvicorn_access_log",
                        action="store_false",
                        help="no access log: the default (vLLM's flag, whose default is "
                             "on)")
    parser.add_argument("--uvicorn-log-level", default="warning",
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="uvicorn's log level")


def serve_config_from(ns: argparse.Namespace) -> Any:
    """The ServeConfig of parsed `serve` flags."""
    from pagedllm.entrypoints.openai.serve_config import ServeConfig

    return ServeConfig(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(ServeConfig)})


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)}
    if getattr(ns, "model_pos", None):
        values["model"] = ns.model_pos
    return EngineArgs(**values)


def _cmd_generate(ns: argparse.Namespace) -> int:
    from pagedllm import LLM, SamplingParams

    llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
    params = SamplingParams(temperature=ns.temperature, top_p=ns.top_p,
                            max_tokens=ns.max_tokens, seed=ns.sampling_seed)
    prompts = ns.prompts or ["The capital of France is", "Here is a short poem about the sea:"]
    if ns.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                        use_tqdm=False)
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        print(f"Prompt: {prompt!r}")
        print(f"Output: {out.outputs[0].text!r}  [{out.outputs[0].finish_reason}]\n")
    return 0


def _cmd_models(ns: argparse.Namespace) -> int:
    from pagedllm.models.registry import supported_architectures

    print("\n".join(supported_architectures()))
    return 0


def _cmd_disagg_proxy(ns: argparse.Namespace) -> int:
    from pagedllm.entrypoints.disagg_proxy import run

    run(ns.prefill, ns.decode, ns.host, ns.port, ns.max_body_bytes)
    return 0


def _cmd_serve(ns: argparse.Namespace) -> int:
    import asyncio

    from pagedllm.entrypoints.openai.server import serve

    asyncio.run(serve(ns, engine_args_from(ns), serve_config_from(ns)))
    return 0


def _cmd_run_batch(ns: argparse.Namespace) -> int:
    import asyncio

    from pagedllm.entrypoints.openai.run_batch import run_batch

    return asyncio.run(run_batch(ns, engine_args_from(ns), serve_config_from(ns)))


def _cmd_chat(ns: argparse.Namespace) -> int:
    from pagedllm.entrypoints.chat import run_chat

    return run_chat(engine_args_from(ns), ns)


def _cmd_bench(ns: argparse.Namespace) -> int:
    from pagedllm.bench import latency, serve, throughput

    if ns.bench_command == "serve":
        serve.run(ns)
    else:
        module = throughput if ns.bench_command == "throughput" else latency
        module.run(ns, engine_args_from(ns))
    return 0


def _add_bench(sub: Any) -> None:
    """`bench throughput | latency` (offline engines) and `bench serve` (HTTP client)."""
    from pagedllm.bench import latency, serve, throughput

    bench = sub.add_parser("bench", help="benchmarks (JSON on stdout, summary on stderr)")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    tp = kinds.add_parser("throughput", help="offline: all requests submitted at once")
    throughput.add_cli_args(tp)
    add_engine_args(tp)
    lat = kinds.add_parser("latency", help="one request at a time: TTFT, decode speed, "
                                           "start-up")
    latency.add_cli_args(lat)
    add_engine_args(lat)
    # Repeating one prompt must recompute it, not hit the prefix cache.
    lat.set_defaults(enable_prefix_caching=False)
    srv = kinds.add_parser("serve", help="async client against a running OpenAI-compatible "
                                         "server")
    serve.add_cli_args(srv)
    bench.set_defaults(func=_cmd_bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for prompts (offline)")
    gen.add_argument("prompts", nargs="*", help="prompt texts (default: two examples)")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    gen.add_argument("--chat", action="store_true", help="apply the chat template")
    add_engine_args(gen)
    gen.set_defaults(func=_cmd_generate)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                           description="Serve MODEL (default: the bundled SmolLM2) with "
                                       "OpenAI's API on http://HOST:PORT/v1.")
    add_serve_args(serve)
    serve.add_argument("--config", default=None, metavar="FILE.yaml",
                       help="read options from a YAML file of option: value lines, as "
                            "vLLM's (names with - or _; true turns a flag on, a list "
                            "gives one value each, an object goes as JSON); options on "
                            "the command line win")
    add_logging_args(serve)
    add_engine_args(serve, positional_model=True)
    serve.set_defaults(func=_cmd_serve)
    batch = sub.add_parser(
        "run-batch", help="run a file of API requests (OpenAI's batch format) offline",
        description="Run each line of INPUT ({\"custom_id\", \"method\": \"POST\", "
                    "\"url\": \"/v1/chat/completions\", \"body\": {...}}; also "
                    "/v1/completions, /v1/embeddings, /v1/messages, /score, /rerank, "
                    "...) through the server's routes in-process, writing one line per "
                    "request to OUTPUT in input order ({\"id\", \"custom_id\", "
                    "\"response\": {\"status_code\", \"request_id\", \"body\"}, "
                    "\"error\"}), as vLLM's run-batch.")
    batch.add_argument("-i", "--input-file", required=True, metavar="INPUT",
                       help="the requests, one JSON object a line (- for stdin)")
    batch.add_argument("-o", "--output-file", required=True, metavar="OUTPUT",
                       help="where the results go, one JSON object a line (- for stdout)")
    batch.add_argument("--max-concurrency", type=int, default=1024,
                       help="most requests in flight at once (the engine batches them; "
                            "results wait, in order, for the oldest)")
    add_model_serving_args(batch)
    add_logging_args(batch)
    add_engine_args(batch, positional_model=True)
    batch.set_defaults(func=_cmd_run_batch)
    chat = sub.add_parser("chat", help="interactive chat in the terminal (reads stdin lines)")
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--max-tokens", type=int, default=512, help="tokens per reply at most")
    chat.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    chat.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass")
    chat.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    add_engine_args(chat, positional_model=True)
    chat.set_defaults(func=_cmd_chat)
    _add_bench(sub)
    proxy = sub.add_parser(
        "disagg-proxy", help="disaggregated prefill: each request's prompt computed by a "
                             "prefill server, its answer by a decode server",
        description="Send each completion or chat request first to a prefill server "
                    "(kv_role kv_producer) with one token to generate, then to a decode "
                    "server (kv_consumer) that loads the prompt's blocks from the shared "
                    "directory (both started with the same --kv-transfer-config path); "
                    "the decode server's answer is streamed back.")
    proxy.add_argument("--prefill", action="append", required=True, metavar="URL",
                       help="a prefill server's base URL, e.g. http://localhost:8100 "
                            "(repeat for several: taken in turn)")
    proxy.add_argument("--decode", action="append", required=True, metavar="URL",
                       help="a decode server's base URL (repeat for several)")
    proxy.add_argument("--host", default="127.0.0.1", help="address to listen on")
    proxy.add_argument("--port", type=int, default=8000, help="port to listen on")
    proxy.add_argument("--max-body-bytes", type=int, default=2 << 20,
                       help="most bytes of a request body (413 beyond), as the servers'")
    proxy.set_defaults(func=_cmd_disagg_proxy)
    models = sub.add_parser("models", help="list supported model architectures")
    models.set_defaults(func=_cmd_models)
    return parser


def add_logging_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's logging flags (pagedllm/log_config.py); later ones override earlier."""
    group = parser.add_argument_group("logging")
    group.add_argument("--logging-config", type=_json_object, default=None,
                       help="a JSON object of log_level (DEBUG .. CRITICAL), formatter "
                            "(text, json: one JSON object a line, uvicorn's too), "
                            "configure_logging (false: leave logging alone) and "
                            "pylogging_config_file (a logging.config.dictConfig JSON "
                            "file); default: env PAGEDLLM_LOGGING_CONFIG, else INFO text")
    for name, kind in (("log_level", str), ("formatter", str),
                       ("configure_logging", _json_bool), ("pylogging_config_file", str)):
        group.add_argument(f"--logging-config.{name}", dest=f"logging_config_{name}",
                           type=kind, default=None, help=f"--logging-config's {name}")
    group.add_argument("--log-level", default=None,
                       help="the log level (overrides --logging-config's log_level)")
    group.add_argument("--log-config-file", default=None,
                       help="a logging.config.dictConfig JSON file (vLLM's older flag: "
                            "--logging-config's pylogging_config_file)")


def _json_bool(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() == "true"


def logging_config_from(ns: argparse.Namespace) -> Any:
    """The LoggingConfig of the flags over the environment's over the defaults."""
    from pagedllm.log_config import LoggingConfig

    config = LoggingConfig.from_env()
    values = dataclasses.asdict(config) | (getattr(ns, "logging_config", None) or {})
    for field in dataclasses.fields(LoggingConfig):
        dotted = getattr(ns, f"logging_config_{field.name}", None)
        if dotted is not None:
            values[field.name] = dotted
    if getattr(ns, "log_level", None) is not None:
        values["log_level"] = ns.log_level
    if getattr(ns, "log_config_file", None) is not None:
        values["pylogging_config_file"] = ns.log_config_file
    return LoggingConfig.from_dict(values)


def config_file_args(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """The command-line arguments a --config YAML file stands for, under `parser`'s
    options (ConfigError for a file that cannot be read or an option it lacks)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            values = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"--config {path!r}: {e}") from None
    if values is None:
        return []
    if not isinstance(values, dict):
        raise ConfigError(f"--config {path!r} must hold option: value lines")
    actions = {opt: a for a in parser._actions for opt in a.option_strings}
    args: list[str] = []
    for key, value in values.items():
        if value is None:  # `option:` with no value: its default
            continue
        flag = "--" + str(key).replace("_", "-")
        action = actions.get(flag)
        if action is None or flag == "--config":
            raise ConfigError(f"--config {path!r}: no option {flag}")
        if action.nargs == 0:  # a flag: true turns it on
            if not isinstance(value, bool):
                raise ConfigError(f"--config {path!r}: {key} takes true or false, "
                                  f"got {value!r}")
            if isinstance(action, argparse.BooleanOptionalAction):
                args.append(flag if value else "--no-" + flag[2:])
            elif value:
                args.append(flag)
            continue
        items = value if isinstance(value, list) else [value]
        texts = [json.dumps(v) if isinstance(v, (dict, list)) else
                 str(v).lower() if isinstance(v, bool) else str(v) for v in items]
        if isinstance(action, argparse._AppendAction):
            for text in texts:
                args += [flag, text]
        elif isinstance(value, list) and action.nargs not in ("+", "*"):
            args += [flag, json.dumps(value)]  # a JSON-list option
        else:
            args += [flag, *texts]
    return args


def _apply_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """`serve --config FILE`: the file's options become the serve parser's defaults,
    so the command line's win (its positional model too: the file's arguments are
    parsed on their own, never next to the command line's)."""
    if not argv or argv[0] != "serve":
        return
    path = None
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
    if path is None:
        return
    serve = parser._subparsers._group_actions[0].choices["serve"]
    from_file = serve.parse_args(config_file_args(serve, path))
    serve.set_defaults(**{dest: value for dest, value in vars(from_file).items()
                          if value != serve.get_default(dest)})


def main(argv: list[str] | None = None) -> int:
    import os

    from pagedllm import log_config

    parser = build_parser()
    argv = expand_dotted_flags(list(sys.argv[1:] if argv is None else argv),
                               json_object_flags(EngineArgs))
    try:
        _apply_config_file(parser, argv)
    except ConfigError as e:
        print(f"pagedllm serve: error: {e}", file=sys.stderr)
        return 2
    ns = parser.parse_args(argv)
    try:
        config = logging_config_from(ns)
        log_config.configure(config)
        # The engine processes this one spawns set themselves up the same way.
        os.environ[log_config.ENV] = config.to_env()
        return ns.func(ns)
    except KeyboardInterrupt:
        # Ctrl-C: the commands release what they hold on the way out (the server stops
        # gracefully, then uvicorn raises the SIGINT again); a traceback would read as
        # a crash. 130: the shell's code for a SIGINT.
        return 130
    except (ConfigError, ModelLoadError) as e:
        # Options or a model that cannot run as given: the message names what is wrong,
        # and a traceback through the start-up code would bury it (argparse's format).
        print(f"pagedllm {ns.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
