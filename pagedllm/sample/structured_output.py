"""Structured output with xgrammar: grammar per constraint, one matcher per request.

The engine core owns the matchers (engine/structured_output.py): it compiles each
constraint off its loop, fills the token bitmask of the requests that sample in a step
(sent with the step, applied to the logits by the sampler) and advances the matchers with
the tokens that come back. The grammar compiler needs the HF tokenizer, loaded with the
first compile; the compiles run in a child process under CPU-time and memory limits
(grammar_process.py); compiled grammars are cached by the constraint (least recently
used dropped past a memory budget).

EOS is allowed only where the grammar may end; the request then finishes through the
scheduler's ordinary EOS check. xgrammar is imported lazily (only when used).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pagedllm.errors import InvalidRequestError
from pagedllm.sample.grammar_process import (GrammarCompileError, GrammarCompileProcess,
                                             compile_constraint, xgrammar_message)
from pagedllm.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:  # the engine core imports this module; torch stays out of its import
    import torch

logger = logging.getLogger(__name__)


def choice_to_ebnf(choices: list[str]) -> str:
    """root ::= "a" | "b" | ...; JSON string escapes are valid EBNF string escapes."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _json_schema_text(schema: str | dict) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)


def structural_tag_text(tag: str | dict) -> str:
    """A structural tag as xgrammar's JSON: {"type": "structural_tag", "format": ...}
    as given; vLLM's older {"structures": [{"begin", "schema", "end"}], "triggers"}
    as the same constraint in that form (free text; each trigger starts one of the
    tagged JSON blocks). InvalidRequestError for anything else."""
    value = json.loads(tag) if isinstance(tag, str) else tag
    if not isinstance(value, dict):
        raise InvalidRequestError("structured_outputs.structural_tag must be a JSON object")
    if "format" in value:
        return json.dumps(value)
    structures, triggers = value.get("structures"), value.get("triggers")
    if not isinstance(structures, list) or not isinstance(triggers, list):
        raise InvalidRequestError("structured_outputs.structural_tag needs \"format\", or "
                                  "\"structures\" and \"triggers\" lists")
    try:
        tags = [{"type": "tag", "begin": s["begin"], "end": s["end"],
                 "content": {"type": "json_schema", "json_schema": s["schema"]}}
                for s in structures]
    except (KeyError, TypeError) as e:
        raise InvalidRequestError(f"structured_outputs.structural_tag: each structure "
                                  f"needs begin, schema and end ({e})") from e
    return json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": triggers, "tags": tags}})


def constraint_spec(params: StructuredOutputsParams) -> tuple[str, str, bool]:
    """(kind, spec, any_whitespace) as xgrammar takes the constraint: a JSON schema's
    text, a regex, EBNF (choices as EBNF, kind "grammar"), a structural tag's JSON, or ""
    for "json_object". InvalidRequestError for a structural tag of neither form."""
    kind, spec = params.kind, ""
    if kind == "json":
        spec = _json_schema_text(params.json)
    elif kind == "regex":
        spec = params.regex
    elif kind == "choice":
        kind, spec = "grammar", choice_to_ebnf(params.choice)
    elif kind == "grammar":
        spec = params.grammar
    elif kind == "structural_tag":
        spec = structural_tag_text(params.structural_tag)
    return kind, spec, not params.disable_any_whitespace


# Compiled grammars kept for reuse: a big enum or schema compiles to tens of MB, and a
# stream of distinct ones must not grow the cache without bound.
MAX_CACHE_BYTES = 256 << 20
# Constraints remembered as failed to compile.
MAX_FAILED = 256


class GrammarManager:
    """Compiles constraints (cached) and makes per-request matchers.

    `compile` may run for seconds (it grows with the constraint: a JSON-schema enum of
    60,000 strings takes ~3 s); the engine calls it from one background thread, never
    from two at once. With a CPU-time or memory limit (seconds, bytes; 0 = none) the
    compiles run in a child process that is killed when one overruns
    (grammar_process.py); with neither, in this process.
    """

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int,
                 max_cache_bytes: int = MAX_CACHE_BYTES, compile_cpu_limit_s: float = 0.0,
                 compile_memory_limit_bytes: int = 0) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.max_cache_bytes = max_cache_bytes
        self.compile_cpu_limit_s = compile_cpu_limit_s
        self.compile_memory_limit_bytes = compile_memory_limit_bytes
        self._info: Any = None
        self._compiler: Any = None  # GrammarCompileProcess, or xgrammar's compiler
        # cache_key -> (compiled grammar, its size), least recently used first.
        self._compiled: OrderedDict[tuple, tuple[Any, int]] = OrderedDict()
        self._cache_bytes = 0
        # sha256 of a cache_key -> why it did not compile, for the latest MAX_FAILED
        # failures: the limits are in CPU time and memory, not wall time, so a retry (a
        # sample of the same request, the same client again) would fail alike, a minute
        # later.
        self._failed: OrderedDict[bytes, str] = OrderedDict()
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether shutdown() was called (a warm-up or compile failing after it is no
        error)."""
        return self._closed

    @property
    def uses_process(self) -> bool:
        return bool(self.compile_cpu_limit_s or self.compile_memory_limit_bytes)

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            tokenizer = self._load_tokenizer()
            # vocab_size = the model's (may exceed the tokenizer's: padded embeddings).
            self._info = xgr.TokenizerInfo.from_huggingface(tokenizer,
                                                            vocab_size=self.vocab_size)
            if self._closed:  # shut down while the above ran (seconds): start nothing
                raise GrammarCompileError("the grammar compiler was shut down",
                                          lasting=False)
            if self.uses_process:
                self._compiler = GrammarCompileProcess(
                    self._info.serialize_json(), self.compile_cpu_limit_s,
                    self.compile_memory_limit_bytes)
            else:
                # Its own cache is unbounded: ours (by constraint, bounded) replaces it.
                self._compiler = xgr.GrammarCompiler(self._info, max_threads=2,
                                                     cache_enabled=False)
        return self._compiler

    def warm_up(self) -> None:
        """Load what the first compile needs (xgrammar, the tokenizer's info, the
        compiler process: seconds) before a request waits for it."""
        compiler = self._get_compiler()
        if isinstance(compiler, GrammarCompileProcess):
            compiler.start()

    def compile(self, params: StructuredOutputsParams, key: tuple | None = None) -> Any:
        """The compiled grammar of `params` (`key`: its cache_key(), when the caller has
        it: a big schema's takes ~15 ms); GrammarCompileError if it failed or ran over a
        limit."""
        key = key if key is not None else params.cache_key()
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return self._compiled[key][0]
        digest = hashlib.sha256(repr(key).encode()).digest()
        if digest in self._failed:
            raise GrammarCompileError(self._failed[digest])
        try:
            compiled = self._compile(params)
        except GrammarCompileError as e:
            if e.lasting:
                self._failed[digest] = str(e)
                if len(self._failed) > MAX_FAILED:
                    self._failed.popitem(last=False)
            raise
        size = compiled.memory_size_bytes
        self._compiled[key] = (compiled, size)
        self._cache_bytes += size
        while self._cache_bytes > self.max_cache_bytes and len(self._compiled) > 1:
            _, (_, dropped) = self._compiled.popitem(last=False)
            self._cache_bytes -= dropped
        return compiled

    def _compile(self, params: StructuredOutputsParams) -> Any:
        compiler = self._get_compiler()
        kind, spec, any_whitespace = constraint_spec(params)
        if self.uses_process:
            import xgrammar as xgr

            compiled = xgr.CompiledGrammar.deserialize_json(
                compiler.compile(kind, spec, any_whitespace), self._info)
        else:
            try:
                compiled = compile_constraint(compiler, kind, spec, any_whitespace)
            except RuntimeError as e:
                raise GrammarCompileError(xgrammar_message(e)) from e
        return compiled

    def shutdown(self) -> None:
        self._closed = True
        if isinstance(self._compiler, GrammarCompileProcess):
            self._compiler.shutdown()

    @property
    def cache_bytes(self) -> int:
        return self._cache_bytes

    @property
    def num_cached(self) -> int:
        return len(self._compiled)

    def new_matcher(self, compiled: Any, eos_token_id: int | None) -> Any:
        """A matcher at the start of `compiled` (what `compile` returned)."""
        import xgrammar as xgr

        stop = [eos_token_id] if eos_token_id is not None else None
        return xgr.GrammarMatcher(compiled, override_stop_tokens=stop)

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        import xgrammar as xgr

        return xgr.allocate_token_bitmask(num_rows, self.vocab_size)


def fill_bitmask(matchers: list[Any], bitmask: torch.Tensor) -> None:
    """Write matcher i's allowed-token mask into bitmask[i]."""
    for row, matcher in enumerate(matchers):
        if matcher.is_terminated():
            # Finished grammar (ignore_eos kept it going): leave the row unconstrained.
            bitmask[row].fill_(-1)
        else:
            matcher.fill_next_token_bitmask(bitmask, row)


def allow_token(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """Set token_id's bit in bitmask[row] (xgrammar's layout: 32 tokens per int32 word,
    token k at bit k % 32; bit 31 is the word's sign)."""
    bit = 1 << (token_id & 31)
    if bit >= 1 << 31:
        bit -= 1 << 32
    word = int(bitmask[row, token_id >> 5])
    bitmask[row, token_id >> 5] = word | bit


def accept_tokens(matchers: list[Any], token_ids: list[int]) -> None:
    for matcher, token_id in zip(matchers, token_ids):
        if not matcher.is_terminated() and not matcher.accept_token(token_id):
            logger.warning("grammar rejected sampled token %d", token_id)
