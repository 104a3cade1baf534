"""A GGUF file's tokenizer made to split text as llama.cpp does, where transformers'
conversion of its metadata does not (llama.cpp's own ids are the reference for a GGUF
file: tests/loader/test_gguf_vocab.py checks them).

- Sentencepiece vocabularies (`tokenizer.ggml.model` "llama") with a prefix space
  (`tokenizer.ggml.add_space_prefix`, default true): llama.cpp puts a space before every
  stretch of text that starts the prompt or follows a special token, whatever that text
  starts with. transformers builds them with `Metaspace(prepend_scheme="first")`, which
  prefixes the start of the prompt only, and not when it starts with a space: "<s>[INST]"
  (every Llama 2 / Mistral chat template writes its bos_token) gave '[' for llama.cpp's
  '▁[', "Hello</s>World" 'World' for '▁World', and " Hello" ['▁Hello'] for
  ['▁', '▁Hello']. A normalizer prefixing every stretch (what transformers builds for
  Phi-3, and Llama 2's own tokenizer.json) splits them as llama.cpp does.
- Phi-3 (a `general.name` containing "phi-3" or "phi3", as llama.cpp matches it): its
  special tokens eat the whitespace after them (rstrip), as in Phi-3's own
  tokenizer.json, but for <unk>, <s> and <|endoftext|>; transformers adds them without:
  "<|user|>\nHi" kept the newline llama.cpp and Phi-3 drop.
- Tokens transformers adds that the file does not have: a byte-level vocabulary gets
  GPT-2's "<|endoftext|>" as a token past its end when it has none of that spelling
  (Llama 3's: id 128,256 of a 128,256-token model), so a prompt holding that text
  failed with an id out of range; llama.cpp reads it as plain text.
- BPE vocabularies of the pre-tokenizers llama.cpp reads with `ignore_merges` (Llama 3's
  among them): a pre-token found whole in the vocabulary is one token, before any merge
  ("Cửa Việt": ' Việt' is one token of Llama 3's, two merges made it two).
"""

from __future__ import annotations

import json
from typing import Any

from pagedllm.loader.gguf import read_field

# The `tokenizer.ggml.pre` values llama.cpp loads with ignore_merges (src/llama-vocab.cpp,
# llama-cpp-python 0.3.36's copy).
IGNORE_MERGES_PRE = frozenset({
    "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
    "lfm2", "jina-v5-nano", "minicpm5", "youtu", "glm4", "glm5", "tekken",
    "granite-embed-multi-97m"})
SPACE = "\u2581"  # sentencepiece's spelling of a space


def match_llama_cpp(tokenizer: Any, reader: Any) -> None:
    """Change `tokenizer` (transformers' fast tokenizer of the GGUF file `reader` parsed)
    in place where its splitting departs from llama.cpp's (the module docstring)."""
    from tokenizers import models, pre_tokenizers

    backend = tokenizer.backend_tokenizer
    kind = read_field(reader, "tokenizer.ggml.model")
    if kind == "llama":
        if isinstance(backend.pre_tokenizer, pre_tokenizers.Metaspace):
            _prefix_each_stretch(backend, read_field(reader, "tokenizer.ggml.add_space_prefix",
                                                     True))
        if any(name in str(read_field(reader, "general.name", "")).lower()
               for name in ("phi-3", "phi3")):
            _strip_after_special(backend)
    elif (kind == "gpt2" and read_field(reader, "tokenizer.ggml.pre") in IGNORE_MERGES_PRE
          and isinstance(backend.model, models.BPE)):
        backend.model.ignore_merges = True
    _drop_foreign_tokens(tokenizer, len(reader.get_field("tokenizer.ggml.tokens").data))


def _prefix_each_stretch(backend: Any, add_space_prefix: bool) -> None:
    """Spaces spelled as sentencepiece's, and (`add_space_prefix`) one put before every
    stretch of text between special tokens, by the normalizer instead of `Metaspace`."""
    from tokenizers import decoders, normalizers

    replace = normalizers.Replace(" ", SPACE)
    if add_space_prefix:
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), replace])
    else:  # no prefix to add, and none to strip from a decoded text
        backend.normalizer = replace
        backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "),
                                             decoders.ByteFallback(), decoders.Fuse()])
    backend.pre_tokenizer = None


def _strip_after_special(backend: Any) -> None:
    """Phi-3's added tokens made to strip the whitespace after them (re-adding a token
    changes its options in place), but for those llama.cpp exempts."""
    from tokenizers import AddedToken

    backend.add_tokens([
        AddedToken(t.content, single_word=t.single_word, lstrip=t.lstrip,
                   rstrip=t.content not in ("<unk>", "<s>", "<|endoftext|>"),
                   normalized=t.normalized, special=t.special)
        for t in backend.get_added_tokens_decoder().values()])


def _drop_foreign_tokens(tokenizer: Any, vocab_size: int) -> None:
    """Remove the added tokens of ids at or past `vocab_size` (the tokenizers library
    removes none: its state is edited and read back)."""
    from tokenizers import Tokenizer

    state = json.loads(tokenizer.backend_tokenizer.to_str())
    kept = [t for t in state["added_tokens"] if t["id"] < vocab_size]
    if len(kept) < len(state["added_tokens"]):
        state["added_tokens"] = kept
        tokenizer._tokenizer = Tokenizer.from_str(json.dumps(state))
