"""Typed user-facing errors.

Anything a user can cause (a bad prompt, a bad parameter, a missing model) raises one
of these; `assert` is kept for internal invariants only. The server maps
`InvalidRequestError` to HTTP 400 with an OpenAI-style error body.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request (prompt or sampling parameters) the engine cannot serve as given."""


class ContextLengthError(InvalidRequestError):
    """A prompt (with the tokens asked for) longer than the model's context or the KV
    cache: what a Responses request with truncation "auto" drops items for."""


class ModelLoadError(ValueError):
    """The model path, format or architecture cannot be loaded."""


class ConfigError(ValueError):
    """Engine or server options (arguments, flags, environment) that cannot work as
    given, alone, together or with the model."""


class EngineDeadError(RuntimeError):
    """The engine core stopped; in-flight and new requests fail with this."""


class EngineSleepingError(RuntimeError):
    """A request sent while the engine sleeps (sleep mode): wake it up first (the server
    answers 503)."""


class EngineBusyError(RuntimeError):
    """Something only an idle engine can do (going to sleep) asked while requests are
    unfinished (the server answers 409)."""
