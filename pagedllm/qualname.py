"""Objects named by import path, as the user's plug-ins are given (logits processors,
tool-call parsers, server middleware)."""

from __future__ import annotations

import importlib
from typing import Any


def import_by_name(name: str) -> Any:
    """The object "package.module:Name" or "package.module.Name" names; ValueError saying
    why when there is none (not such a path, the module does not import, or it has no
    such name)."""
    module_name, sep, attr = name.partition(":")
    if not sep:
        module_name, _, attr = name.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{name!r} is not a qualified class name (package.module.Class "
                         f"or package.module:Class)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import {module_name!r} for {name!r}: {e}") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no {attr!r}") from None


def import_subclass(name: str, base: type, what: str) -> type:
    """The class `name` names (import_by_name), which must subclass `base`; ValueError
    naming `what` (the option or the plug-in) otherwise."""
    try:
        cls = import_by_name(name)
    except ValueError as e:
        raise ValueError(f"{what} {name!r}: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(f"{what} {name!r} is not a subclass of "
                         f"{base.__module__}.{base.__qualname__}")
    return cls
