"""How deeply a JSON value from a request may nest.

Python's JSON decoder, pickling (requests cross to the engine core pickled) and every
recursive walk over a value stop at the interpreter's recursion limit with a
RecursionError, which is no ValueError: unchecked, a few kilobytes of brackets turned
into a 500. Values are therefore measured without recursion and refused, with a
ValueError naming the field, beyond a depth that no schema, tool call or template
argument needs.
"""

from __future__ import annotations

import json
from typing import Any

from pagedllm.errors import InvalidRequestError

MAX_JSON_DEPTH = 100
"""Deepest nesting of lists / dicts accepted in a request value (the value itself is
level 1). Real JSON schemas nest a few dozen levels at most (two per level of object:
`properties`, then the property); pickling still works at 400, and xgrammar's compile
time grows steeply with depth (arrays nested 300 deep took ~3 s to check, 800 deep
over a minute; 100 deep ~0.1 s)."""


def nesting_depth(value: Any, limit: int | None = None) -> int:
    """Levels of list / dict nesting of `value` (0 for a scalar), without recursion;
    with `limit`, the walk stops at the first container deeper than it (and returns its
    depth). Only containers are visited."""
    if not isinstance(value, (dict, list, tuple)):
        return 0
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > deepest:
            deepest = depth
            if limit is not None and depth > limit:
                break
        for child in item.values() if isinstance(item, dict) else item:
            if isinstance(child, (dict, list, tuple)):
                stack.append((child, depth + 1))
    return deepest


def check_depth(value: Any, what: str) -> None:
    """InvalidRequestError when `value` nests deeper than MAX_JSON_DEPTH."""
    if nesting_depth(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise InvalidRequestError(f"{what} is nested more than {MAX_JSON_DEPTH} levels deep")


def loads(text: str, what: str) -> Any:
    """`json.loads(text)`, with InvalidRequestError naming `what` for invalid JSON and for
    nesting deeper than MAX_JSON_DEPTH."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise InvalidRequestError(
            f"{what} is nested more than {MAX_JSON_DEPTH} levels deep") from None
    except ValueError as e:
        raise InvalidRequestError(f"{what} is not valid JSON: {e}") from None
    check_depth(value, what)
    return value
