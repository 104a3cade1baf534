"""Structured output with xgrammar: grammar per constraint, one matcher per request.

The matchers live on the model runner side, next to the sampler: each step they fill a
token bitmask for their rows (applied to the logits before sampling) and are advanced
with the sampled tokens. The grammar compiler needs the HF tokenizer, loaded on the
first structured request; compiled grammars are cached by the constraint.

EOS is allowed only where the grammar may end; the request then finishes through the
scheduler's ordinary EOS check. xgrammar is imported lazily (only when used).
"""

from __future__ import annotations

import functools

import json
import logging
from collections.abc import Callable
from typing import Any

import torch

from pagedllm.errors import InvalidRequestError
from pagedllm.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)


def choice_to_ebnf(choices: list[str]) -> str:
    """root ::= "a" | "b" | ...; JSON string escapes are valid EBNF string escapes."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _json_schema_text(schema: str | dict) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)


def validate_structured_outputs(params: StructuredOutputsParams) -> None:
    """Parse the constraint without a tokenizer; InvalidRequestError if it is malformed.

    Run by the input processor, so a bad schema fails its request up front instead of
    inside the engine step (the server runs it first off the event loop: a large schema
    takes a while). Valid constraints are remembered, so a repeat costs nothing.
    """
    _validate_constraint(params.cache_key())


@functools.lru_cache(maxsize=512)
def _validate_constraint(key: tuple) -> None:
    """`key` is StructuredOutputsParams.cache_key(): (kind, value, disable_any_whitespace),
    with a JSON schema as sorted JSON text and choices as a tuple."""
    import xgrammar as xgr

    kind, value, disable_any_whitespace = key
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(_json_schema_text(value),
                                         any_whitespace=not disable_any_whitespace)
        elif kind == "regex":
            xgr.Grammar.from_regex(value)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(choice_to_ebnf(list(value)))
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(value)
    except (RuntimeError, ValueError) as e:
        raise InvalidRequestError(
            f"invalid structured_outputs.{kind}: {str(e).strip().splitlines()[-1]}") from e


class GrammarManager:
    """Compiles constraints (cached) and makes per-request matchers."""

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self._compiler: Any = None
        self._compiled: dict[tuple, Any] = {}

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            tokenizer = self._load_tokenizer()
            # vocab_size = the model's (may exceed the tokenizer's: padded embeddings).
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        return self._compiler

    def compile(self, params: StructuredOutputsParams) -> Any:
        key = params.cache_key()
        compiled = self._compiled.get(key)
        if compiled is None:
            compiler = self._get_compiler()
            kind = params.kind
            if kind == "json":
                compiled = compiler.compile_json_schema(
                    _json_schema_text(params.json),
                    any_whitespace=not params.disable_any_whitespace)
            elif kind == "json_object":
                compiled = compiler.compile_builtin_json_grammar()
            elif kind == "regex":
                compiled = compiler.compile_regex(params.regex)
            elif kind == "choice":
                compiled = compiler.compile_grammar(choice_to_ebnf(params.choice))
            else:
                compiled = compiler.compile_grammar(params.grammar)
            self._compiled[key] = compiled
        return compiled

    def new_matcher(self, params: StructuredOutputsParams, eos_token_id: int | None,
                    output_token_ids: list[int]) -> Any:
        """A matcher positioned after `output_token_ids` (tokens generated before a
        preemption are replayed so the grammar state matches the sequence)."""
        import xgrammar as xgr

        stop = [eos_token_id] if eos_token_id is not None else None
        matcher = xgr.GrammarMatcher(self.compile(params), override_stop_tokens=stop)
        for token_id in output_token_ids:
            matcher.accept_token(token_id)
        return matcher

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        import xgrammar as xgr

        return xgr.allocate_token_bitmask(num_rows, self.vocab_size)


def fill_bitmask(matchers: list[Any], logits_rows: list[int], bitmask: torch.Tensor) -> None:
    """Write each matcher's allowed-token mask into bitmask[logits_row]."""
    for matcher, row in zip(matchers, logits_rows):
        if matcher.is_terminated():
            # Finished grammar (ignore_eos kept it going): leave the row unconstrained.
            bitmask[row].fill_(-1)
        else:
            matcher.fill_next_token_bitmask(bitmask, row)


def accept_tokens(matchers: list[Any], token_ids: list[int]) -> None:
    for matcher, token_id in zip(matchers, token_ids):
        if not matcher.is_terminated() and not matcher.accept_token(token_id):
            logger.warning("grammar rejected sampled token %d", token_id)
