"""Base models of the API: what every request body and response shares.

Request bodies reject what this server would otherwise silently drop: unknown fields,
non-finite numbers, strings that are not valid Unicode, and known OpenAI fields
without an implementation at a value that asks for something (`UNSUPPORTED_FIELDS`).
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import (BaseModel, ConfigDict, GetCoreSchemaHandler, ValidationInfo,
                      field_validator, model_validator)
from pydantic_core import CoreSchema

from pagedllm.errors import InvalidRequestError
from pagedllm.json_limits import MAX_JSON_DEPTH


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    """Response models (and the base of request models)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)


def check_json_value(value: Any, path: str = "") -> None:
    """Raise if a string anywhere in a parsed JSON value holds a lone UTF-16 surrogate
    ("\\ud800" is valid JSON but no tokenizer can encode it), or if the value nests
    deeper than MAX_JSON_DEPTH (json_limits.py). Walked without recursion (a value
    nested ~1000 deep took a recursive walk past Python's limit: a 500), and the path
    of an item is only spelled out for a container with items or an error."""
    stack: list[tuple[Any, str, str | int | None, int]] = [(value, path, None, 1)]
    while stack:
        item, parent, step, depth = stack.pop()
        if isinstance(item, str):
            if item.isascii():
                continue
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InvalidRequestError(
                    f"{_path(parent, step) or 'body'} is not valid Unicode: a lone "
                    f"surrogate U+{ord(item[e.start]):04X} at character {e.start}") from None
            continue
        if not isinstance(item, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise InvalidRequestError(f"{_path(parent, step) or 'body'} is nested more "
                                      f"than {MAX_JSON_DEPTH} levels deep")
        if not item:
            continue
        where = _path(parent, step)
        # Only what could fail goes on the stack: a non-ASCII string, a container with
        # items or past the depth limit (a list of 300k `{}` or ASCII strings: ~30-80 ms).
        if isinstance(item, dict):
            for key, child in item.items():
                if _may_fail(key, depth):
                    stack.append((key, where, None, depth))
                if _may_fail(child, depth):
                    stack.append((child, where, key, depth + 1))
        else:
            stack.extend((child, where, i, depth + 1) for i, child in enumerate(item)
                         if _may_fail(child, depth))


def _may_fail(child: Any, depth: int) -> bool:
    """Whether `child`, an item of a container at `depth`, needs a look of its own."""
    if isinstance(child, str):
        return not child.isascii()
    return isinstance(child, (dict, list)) and (bool(child) or depth >= MAX_JSON_DEPTH)


def _path(parent: str, step: str | int | None) -> str:
    """`parent` extended by a key (`a.key`) or an index (`a[3]`); None: `parent`."""
    if step is None:
        return parent
    if isinstance(step, int):
        return f"{parent}[{step}]"
    return f"{parent}.{step}" if parent else step


# Known OpenAI request fields this server does not implement, and the values that ask
# for nothing (accepted and ignored); any other value is a 400 naming the field.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "functions": (None, []), "function_call": (None, "none"),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
    "store": (None, False), "metadata": (None, {}), "service_tier": (None, "auto", "default"),
    "reasoning_effort": (None,), "web_search_options": (None,), "verbosity": (None,),
    "refusal": (None,), "annotations": (None, []),
}


class RequestModel(OpenAIBaseModel):
    """Base of request bodies: unknown fields, non-finite numbers and invalid Unicode
    are rejected (400)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any,
                                     handler: GetCoreSchemaHandler) -> CoreSchema:
        """The model's schema with every list, tuple, set and dict failing fast: one error
        for its first bad item. Otherwise each bad item is an error of its own, for every
        member of a union: a 2 MB prompt of 300k `{}` gave 900k errors, ~3 s to validate
        and ~7 s to list, on the event loop, and a 52 MB answer."""
        schema = handler(source)
        stack: list[Any] = [schema]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                if node.get("type") in ("list", "tuple", "set", "frozenset", "dict"):
                    node["fail_fast"] = True
                stack.extend(node.values())
            elif isinstance(node, list):
                stack.extend(node)
        return schema

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        check_json_value(data)
        return data

    @field_validator("*", mode="after")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        neutral = UNSUPPORTED_FIELDS.get(info.field_name or "")
        if neutral is not None and value not in neutral:
            raise InvalidRequestError(f"not supported by this server (got "
                                      f"{str(value)[:80]!r})")
        return value
