"""Incremental detokenization: text grows token by token, correct across multi-byte
UTF-8 characters and byte-fallback tokens (a partial character yields no text yet)."""

from __future__ import annotations

from typing import Any

# Prompt tokens given to the decoder as context so the first output token decodes
# with the right leading space (SentencePiece "▁" handling depends on what precedes it).
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Feeds output token ids one by one; `text` is the decoded output so far."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Only slow (Python) tokenizers have this option; fast ones ignore it, as in vLLM.
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.text = ""
        self.token_ids: list[int] = []
        backend = getattr(tokenizer, "_tokenizer", None)
        self._backend = backend
        self._stream = None
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(prompt_token_ids[-_CONTEXT_TOKENS:],
                                        skip_special_tokens)

    def add_tokens(self, token_ids: list[int]) -> str:
        """Append tokens; return the text they added (may be "" for a partial char)."""
        self.token_ids.extend(token_ids)
        if self._stream is None:
            # Slow tokenizers: decode the whole output and take the new suffix.
            full = self.tokenizer.decode(
                self.token_ids, skip_special_tokens=self.skip_special_tokens,
                spaces_between_special_tokens=self.spaces_between_special_tokens)
            delta = full[len(self.text):] if not full.endswith("\ufffd") else ""
            self.text += delta
            return delta
        pieces = [self._stream.step(self._backend, t) for t in token_ids]
        delta = "".join(p for p in pieces if p)
        self.text += delta
        return delta
