"""The check of a request's structured-output constraint before the request is queued.

A constraint xgrammar cannot parse fails its request up front (a 400, or a ValueError
offline), not in the engine step after its stream has begun. A parse is usually a
matter of milliseconds (a 770 KB enum of 60,000 strings: ~0.1 s), but a few bytes can
cost far more: a counted repetition in a JSON schema's `pattern` is expanded into the
grammar at a cost that grows with the square of the count (`(a|b){1,10000}`: ~12 s;
`{1,100000}`: ~20 minutes), and an xgrammar parse cannot be interrupted. So the server
parses in a child process under a CPU-time and a memory limit (grammar_process.py,
killed and started again when a parse runs over), one parse at a time; the offline
engine parses in the caller's thread, where only the caller waits for its own input.

Valid constraints are remembered (the input processor checks again what the server
checked, and a repeat costs nothing), and so are refused ones: a client sending one
that ran over the limit again has its 400 at once.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict

from pagedllm.errors import InvalidRequestError
from pagedllm.sample.grammar_process import (GrammarCompileError, GrammarCompileProcess,
                                             parse_constraint, xgrammar_message)
from pagedllm.sample.structured_output import constraint_spec
from pagedllm.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Constraints remembered as valid, and as refused (least recently used dropped).
MAX_VALID = 512
MAX_REFUSED = 256
WHAT = "checking the structured output constraint"


class ConstraintChecker:
    """Parses constraints without a tokenizer and remembers the outcome.

    With a CPU-time or memory limit (seconds, bytes; 0: none) the parses run in a child
    process, one at a time; with neither, in the calling thread. `limit_names` name the
    options that set the two limits, for the error of a parse that runs over one.
    """

    def __init__(self, cpu_limit_s: float = 0.0, memory_limit_bytes: int = 0,
                 limit_names: tuple[str, str] = ("", "")) -> None:
        self._process = None
        if cpu_limit_s or memory_limit_bytes:
            self._process = GrammarCompileProcess(None, cpu_limit_s, memory_limit_bytes,
                                                  what=WHAT, limit_names=limit_names,
                                                  name="constraint checker")
        # Guards the two memories (held for dictionary updates only, never for a parse:
        # a remembered constraint is answered while another one is parsed).
        self._memo_lock = threading.Lock()
        # The child serves one parse at a time.
        self._parse_lock = threading.Lock()
        self._valid: OrderedDict[tuple, None] = OrderedDict()
        # sha256 of a cache key -> why it was refused (a big schema's key is large).
        self._refused: OrderedDict[bytes, str] = OrderedDict()

    @property
    def uses_process(self) -> bool:
        return self._process is not None

    def check(self, params: StructuredOutputsParams) -> None:
        """Return if `params` parses; InvalidRequestError naming what is wrong if it does
        not or ran over a limit; RuntimeError if the child process could not parse it
        (it died or did not start: nothing is known about the constraint)."""
        key = params.cache_key()
        with self._memo_lock:
            if key in self._valid:  # the input processor's check after the server's
                self._valid.move_to_end(key)
                return
        digest = hashlib.sha256(repr(key).encode()).digest()
        with self._memo_lock:
            refused = self._refused.get(digest)
        if refused is not None:
            raise InvalidRequestError(refused)
        try:
            with self._parse_lock:
                self._parse(params)
        except InvalidRequestError as e:
            with self._memo_lock:
                self._refused[digest] = str(e)
                if len(self._refused) > MAX_REFUSED:
                    self._refused.popitem(last=False)
            raise
        with self._memo_lock:
            self._valid[key] = None
            if len(self._valid) > MAX_VALID:
                self._valid.popitem(last=False)

    def _parse(self, params: StructuredOutputsParams) -> None:
        kind, spec, any_whitespace = constraint_spec(params)
        if self._process is None:
            try:
                parse_constraint(kind, spec, any_whitespace)
            except (RuntimeError, ValueError, TypeError) as e:
                raise InvalidRequestError(f"invalid structured_outputs.{params.kind}: "
                                          f"{xgrammar_message(e)}") from e
            return
        try:
            self._process.compile(kind, spec, any_whitespace)
        except GrammarCompileError as e:
            if e.over_limit:
                raise InvalidRequestError(f"{e}: send a simpler constraint") from None
            if e.lasting:  # xgrammar refused it
                raise InvalidRequestError(f"invalid structured_outputs.{params.kind}: "
                                          f"{e}") from None
            raise RuntimeError(f"{WHAT} failed: {e}") from None

    def warm_up(self) -> None:
        """Start the child process (importing xgrammar: seconds) before a request waits
        for it; in-thread checking imports xgrammar instead."""
        if self._process is None:
            import xgrammar  # noqa: F401
            return
        with self._parse_lock:
            try:
                self._process.start()
            except GrammarCompileError as e:  # the first check starts it again
                if not self._process.closed:
                    logger.warning("%s", e)

    def shutdown(self) -> None:
        if self._process is not None:
            self._process.shutdown()
