"""`pagedllm` command line: generate, models (serve, chat and bench plug in here).

Engine flags are derived from the EngineArgs dataclass, one per field, so every
subcommand that starts an engine shares them and --help documents each.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from typing import Any

from pagedllm.config import EngineArgs


def add_engine_args(parser: argparse.ArgumentParser, positional_model: bool = False) -> None:
    """One --flag per EngineArgs field (bools get --x / --no-x)."""
    group = parser.add_argument_group("engine options")
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        kw: dict[str, Any] = {"default": f.default, "help": f.metadata.get("help", ""),
                              "dest": f.name}
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        hint = hints[f.name]
        if hint is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = _scalar_type(hint)
        if f.name == "model" and positional_model:
            parser.add_argument("model_pos", nargs="?", metavar="MODEL", default=None,
                                help=kw["help"])
        group.add_argument(flag, **kw)


def _scalar_type(hint: Any) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return args[0]


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
    models = sub.add_parser("models", help="list supported model architectures")
    models.set_defaults(func=_cmd_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ns = build_parser().parse_args(argv)
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
