"""collective_rpc: one call run on every rank's worker (vLLM's `LLM.collective_rpc`).

RL frameworks drive an engine's workers this way: weight updates from their own
trainers, checks of what a rank holds. A call is a method name, or a function taking the
worker first, with its arguments, pickled once by the engine and unpickled on each rank;
a function must therefore be importable by name (a module's, not a lambda). The method
is looked up on `RankWorker`, vLLM's worker attributes over this rank's ModelRunner, to
which the engine's `worker_extension_cls` (vLLM's option) adds its methods.
"""

from __future__ import annotations

import functools
import pickle
from typing import Any

from pagedllm.errors import ConfigError
from pagedllm.qualname import import_by_name


class RankWorker:
    """What a collective_rpc method gets as `self` on one rank."""

    def __init__(self, runner: Any, rank: int) -> None:
        self.model_runner = runner
        """The rank's ModelRunner (its `model`, `device`, `update_weights`...)."""
        self.rank = rank
        self.device = runner.device

    @property
    def model(self) -> Any:
        return self.model_runner.model


def extension_class(name: str) -> type:
    """The class `name` (package.module:Class) names, checked to add only new names to
    RankWorker's (ConfigError otherwise): an extension may not replace what the
    engine's own calls rely on."""
    try:
        ext = import_by_name(name)
    except ValueError as e:
        raise ConfigError(f"worker_extension_cls: {e}") from None
    if not isinstance(ext, type):
        raise ConfigError(f"worker_extension_cls {name!r} is not a class")
    ours = {n for n in dir(RankWorker) if not n.startswith("__")} | {
        "model_runner", "rank", "device"}
    clash = sorted(n for n in vars(ext) if not n.startswith("__") and n in ours)
    if clash:
        raise ConfigError(f"worker_extension_cls {name!r} redefines {clash[0]!r}, which "
                          f"the worker has already")
    return ext


def make_rank_worker(runner: Any, rank: int, extension: str) -> RankWorker:
    """The rank's RankWorker, with the extension's methods when one is named."""
    cls = RankWorker
    if extension:
        ext = extension_class(extension)
        cls = type(f"{ext.__name__}Worker", (RankWorker, ext), {})
    return cls(runner, rank)


def encode_call(method: Any, args: tuple, kwargs: dict[str, Any] | None) -> bytes:
    """A call's payload (ValueError when it cannot be pickled, e.g. a lambda)."""
    if not (isinstance(method, str) or callable(method)):
        raise ValueError(f"collective_rpc needs a method name or a function, got "
                         f"{type(method).__name__}")
    try:
        return pickle.dumps((method, tuple(args), dict(kwargs or {})))
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise ValueError(f"collective_rpc's call cannot be sent to the workers (a "
                         f"function must be importable by name, not a lambda or a "
                         f"local one): {e}") from None


def run_call(worker: RankWorker, payload: bytes) -> Any:
    """Run one encoded call on this rank's worker; its result."""
    method, args, kwargs = pickle.loads(payload)
    if isinstance(method, str):
        fn = getattr(worker, method, None)
        if fn is None or not callable(fn):
            raise AttributeError(f"the worker has no method {method!r} (add it with "
                                 f"worker_extension_cls)")
    else:
        fn = functools.partial(method, worker)
    return fn(*args, **kwargs)
