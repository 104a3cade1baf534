"""Base models of the API: what every request body and response shares.

Request bodies reject what this server would otherwise silently drop: unknown fields,
non-finite numbers, strings that are not valid Unicode, and known OpenAI fields
without an implementation at a value that asks for something (`UNSUPPORTED_FIELDS`).
"""

from __future__ import annotations

import uuid
from contextvars import ContextVar
from typing import Any, ClassVar

from pydantic import (BaseModel, ConfigDict, GetCoreSchemaHandler, ModelWrapValidatorHandler,
                      ValidationInfo, field_validator, model_validator)
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
    nested ~1000 deep took a recursive walk past Python's limit: a 500). Only what could
    fail is visited: non-ASCII strings and containers with items (or past the depth
    limit); a location is kept as a (parent, step) chain and spelled out for an error
    only (a body of 45,000 chat messages: ~33 ms, where a walk of the body and one of each
    message, with a path string per container, took ~60)."""
    if isinstance(value, str):
        _check_text(value, path)
        return
    if not isinstance(value, (dict, list)):
        return
    stack: list[tuple[Any, Any, int]] = [(value, path, 1)]
    while stack:
        item, loc, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise InvalidRequestError(f"{_spell(loc) or 'body'} is nested more than "
                                      f"{MAX_JSON_DEPTH} levels deep")
        pairs = item.items() if isinstance(item, dict) else enumerate(item)
        for step, child in pairs:
            if isinstance(step, str) and not step.isascii():
                _check_text(step, loc)
            if isinstance(child, str):
                if not child.isascii():
                    _check_text(child, (loc, step))
            elif isinstance(child, (dict, list)) and (child or depth >= MAX_JSON_DEPTH):
                stack.append((child, (loc, step), depth + 1))


def _check_text(text: str, loc: Any) -> None:
    """Raise naming `loc` if `text` holds a lone surrogate."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(
            f"{_spell(loc) or 'body'} is not valid Unicode: a lone surrogate "
            f"U+{ord(text[e.start]):04X} at character {e.start}") from None


def _spell(loc: Any) -> str:
    """A location chain ((root, step1), step2)... as `root.key[3]` (a key after an
    empty root alone: `key`)."""
    steps = []
    while isinstance(loc, tuple):
        loc, step = loc
        steps.append(step)
    for step in reversed(steps):
        loc = f"{loc}[{step}]" if isinstance(step, int) else f"{loc}.{step}" if loc else step
    return loc


# Known OpenAI request fields this server does not implement, and the values that ask
# for nothing (accepted and ignored); any other value is a 400 naming the field.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "functions": (None, []), "function_call": (None, "none"),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
    "store": (None, False), "metadata": (None, {}), "service_tier": (None, "auto", "default"),
    "web_search_options": (None,), "verbosity": (None,),
    "refusal": (None,), "annotations": (None, []),
}


# Set while a request model validates the value check_json_value has walked (per thread
# and task: bodies are validated in worker threads too).
_CHECKED: ContextVar[bool] = ContextVar("pagedllm_json_checked", default=False)


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

    @model_validator(mode="wrap")
    @classmethod
    def _valid_text(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        # The outermost model checks the whole value; the models within it (one per chat
        # message) need not walk their parts again.
        if _CHECKED.get():
            return handler(data)
        check_json_value(data)
        token = _CHECKED.set(True)
        try:
            return handler(data)
        finally:
            _CHECKED.reset(token)

    # Fields of UNSUPPORTED_FIELDS this model implements (the Responses API's `store`).
    SUPPORTED_FIELDS: ClassVar[frozenset[str]] = frozenset()

    @field_validator("*", mode="after")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name in cls.SUPPORTED_FIELDS:
            return value
        neutral = UNSUPPORTED_FIELDS.get(info.field_name or "")
        if neutral is not None and value not in neutral:
            raise InvalidRequestError(f"not supported by this server (got "
                                      f"{str(value)[:80]!r})")
        return value
