"""Base models of the API: what every request body and response shares.

Request bodies reject what this server would otherwise silently drop: unknown fields,
non-finite numbers, strings that are not valid Unicode, and known OpenAI fields
without an implementation at a value that asks for something (`UNSUPPORTED_FIELDS`).
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator, model_validator

from pagedllm.errors import InvalidRequestError


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    """Response models (and the base of request models)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)


def check_unicode(value: Any, path: str = "") -> None:
    """Raise if a string anywhere in a parsed JSON value holds a lone UTF-16 surrogate
    ("\\ud800" is valid JSON but no tokenizer can encode it)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidRequestError(
                f"{path or 'body'} is not valid Unicode: a lone surrogate "
                f"U+{ord(value[e.start]):04X} at character {e.start}") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(key, path)
            check_unicode(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_unicode(item, f"{path}[{i}]")


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

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        check_unicode(data)
        return data

    @field_validator("*", mode="after")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        neutral = UNSUPPORTED_FIELDS.get(info.field_name or "")
        if neutral is not None and value not in neutral:
            raise InvalidRequestError(f"not supported by this server (got "
                                      f"{str(value)[:80]!r})")
        return value
