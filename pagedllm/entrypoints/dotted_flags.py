"""vLLM's dotted form of the flags whose value is a JSON object:
`--speculative-config.method ngram`, `-cc.cudagraph_mode=none`,
`--compilation-config.pass_config.fuse_norm_quant=true` each set one key (further dots
nest) of that flag's object. The keys of one flag merge into one object, over the object
the flag itself gives (`--compilation-config '{...}'`), and the command line goes on to
argparse with the merged object in their place.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any


def json_object_flags(cls: type) -> dict[str, str]:
    """Every spelling of dataclass `cls`'s dict-valued fields' flags (--x-y and its
    aliases) -> the --x-y form."""
    hints = typing.get_type_hints(cls)
    flags = {}
    for f in dataclasses.fields(cls):
        args = [a for a in typing.get_args(hints[f.name]) if a is not type(None)]
        hint = args[0] if args else hints[f.name]
        if hint is dict or typing.get_origin(hint) is dict:
            flag = "--" + f.name.replace("_", "-")
            for spelling in (flag, *f.metadata.get("aliases", ())):
                flags[spelling] = flag
    return flags


def expand_dotted_flags(argv: list[str], flags: dict[str, str]) -> list[str]:
    """`argv` with every dotted flag of `flags` (json_object_flags) merged into one
    `--flag JSON` per flag, placed where its first part was. A value is read as JSON
    where it parses (numbers, true, lists, objects), as text otherwise. Left as it is:
    a whole object that is not valid JSON (argparse reports it)."""
    out: list[str] = []
    merged: dict[str, dict[str, Any]] = {}
    slot: dict[str, int] = {}  # flag -> index in `out` of its merged value
    i = 0
    while i < len(argv):
        arg = argv[i]
        head, eq, inline = arg.partition("=")
        base, dot, path = head.partition(".")
        flag = flags.get(base)
        if flag is None or (not dot and not eq and i + 1 >= len(argv)):
            out.append(arg)
            i += 1
            continue
        if eq:
            value, i = inline, i + 1
        elif i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
        else:  # a dotted flag with no value: argparse names the flag it does not know
            out.append(arg)
            i += 1
            continue
        if dot:
            update = _nested(path.split("."), _value(value))
        else:
            try:
                update = json.loads(value)
            except json.JSONDecodeError:
                update = None
            if not isinstance(update, dict):
                out += [flag, value]  # argparse's error for it
                continue
        if flag not in slot:
            out += [flag, ""]
            slot[flag] = len(out) - 1
            merged[flag] = {}
        _merge(merged[flag], update)
    for flag, index in slot.items():
        out[index] = json.dumps(merged[flag])
    return out


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _nested(keys: list[str], value: Any) -> dict[str, Any]:
    for key in reversed(keys[1:]):
        value = {key: value}
    return {keys[0]: value}


def _merge(into: dict[str, Any], update: dict[str, Any]) -> None:
    """Recursively: objects merge key by key, anything else replaces."""
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value
