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
- Added tokens: llama.cpp's files keep a byte-level vocabulary's control and
  user-defined tokens as their text; transformers spells those outside the byte
  alphabet as bytes (DeepSeek's "<｜begin▁of▁sentence｜>" and "<｜end▁of▁sentence｜>"),
  so no text matched them, and it added the bos / eos text again past the vocabulary:
  every prompt began with an id out of range (deepseek-coder's BOS 32,257 for 32,013).
  They are put back under their own text at their own ids. And tokens transformers
  adds past the file's vocabulary are dropped: GPT-2's "<|endoftext|>" became id
  128,256 of Llama 3's 128,256-token vocabulary, so a prompt holding that text failed;
  llama.cpp reads it as plain text.
- BPE vocabularies of pre-tokenizer types transformers has no split expressions for
  (DeepSeek LLM's and Coder's, llama-architecture files): llama.cpp's (PRE_SPLITS).
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
CONTROL, USER_DEFINED = 3, 4  # `tokenizer.ggml.token_type` values

# llama.cpp's split expressions for the pre-tokenizer types transformers has none for
# (src/llama-vocab.cpp; the models' own tokenizer.json files split the same way): each
# splits the pieces the one before made, its matches kept as pieces of their own, and
# byte-level BPE runs on the pieces. transformers used GPT-2's one expression: of the
# suite's 316 texts 72 (deepseek-llm) and 100 (deepseek-coder) split otherwise.
PRE_SPLITS: dict[str, tuple[str, ...]] = {
    "deepseek-llm": (
        "[\r\n]",
        "\\s?[A-Za-z\u00b5À-ÖØ-öø-ƺƼ-ƿ\u01c4-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-"
        "\u03f5Ϸ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-"
        "\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼ\u2102\u2107"
        "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d"
        "\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149ⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ"
        "-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿ\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41"
        "-\uff5a𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e‘-‟\u3000-。]+",
        "\\s+$",
        "[一-龥ࠀ-一가-\ud7ff]+",
        "\\p{N}+",
    ),
    "deepseek-coder": (
        "[\r\n]",
        "\\s?\\p{L}+",
        "\\s?\\p{P}+",
        "[一-龥ࠀ-一가-\ud7ff]+",
        "\\p{N}",
    ),
}


def match_llama_cpp(tokenizer: Any, reader: Any) -> None:
    """Change `tokenizer` (transformers' fast tokenizer of the GGUF file `reader` parsed)
    in place where its splitting departs from llama.cpp's (the module docstring)."""
    from tokenizers import Regex, models, pre_tokenizers

    backend = tokenizer.backend_tokenizer
    kind = read_field(reader, "tokenizer.ggml.model")
    if kind == "llama":
        if isinstance(backend.pre_tokenizer, pre_tokenizers.Metaspace):
            _prefix_each_stretch(backend, read_field(reader, "tokenizer.ggml.add_space_prefix",
                                                     True))
        if any(name in str(read_field(reader, "general.name", "")).lower()
               for name in ("phi-3", "phi3")):
            _strip_after_special(backend)
    elif kind == "gpt2":
        pre = read_field(reader, "tokenizer.ggml.pre")
        if pre in IGNORE_MERGES_PRE and isinstance(backend.model, models.BPE):
            backend.model.ignore_merges = True
        if pre in PRE_SPLITS and isinstance(backend.pre_tokenizer, pre_tokenizers.ByteLevel):
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(expr), behavior="isolated")
                 for expr in PRE_SPLITS[pre]]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    _fix_added_tokens(tokenizer, reader, byte_level=kind == "gpt2")


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


def _fix_added_tokens(tokenizer: Any, reader: Any, byte_level: bool) -> None:
    """Added tokens as the file has them: in a byte-level vocabulary, its control and
    user-defined tokens of other characters than the byte alphabet's under their own
    text (llama.cpp's files keep them so, and transformers spelled them as bytes: matched
    in no text, while the config's bos / eos text was added again past the vocabulary);
    and no added token at or past the file's vocabulary size. The tokenizers library
    renames and removes nothing: its state is edited and read back."""
    from tokenizers import Tokenizer

    tokens = read_field(reader, "tokenizer.ggml.tokens")
    vocab_size = len(tokens)
    raw: dict[int, tuple[str, bool]] = {}  # id -> (text, special)
    if byte_level:
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        alphabet = set(bytes_to_unicode().values())
        types = read_field(reader, "tokenizer.ggml.token_type") or []
        raw = {i: (tokens[i], kind == CONTROL) for i, kind in enumerate(types)
               if kind in (CONTROL, USER_DEFINED) and not set(tokens[i]) <= alphabet}
    # Most files need neither: skip the round trip of the whole state (megabytes of JSON).
    if not raw and all(i < vocab_size for i in tokenizer.backend_tokenizer
                       .get_added_tokens_decoder()):
        return
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    kept = [t for t in state["added_tokens"] if t["id"] < vocab_size and t["id"] not in raw]
    vocab = state["model"]["vocab"]
    spelled = {i: token for token, i in vocab.items() if i in raw}
    for i, (text, special) in raw.items():
        vocab.pop(spelled.get(i), None)
        vocab[text] = i
        kept.append({"id": i, "content": text, "single_word": False, "lstrip": False,
                     "rstrip": False, "normalized": False, "special": special})
    state["added_tokens"] = sorted(kept, key=lambda t: t["id"])
    # The post-processor adding BOS holds the id transformers gave the token.
    ids_of = {text: i for i, (text, _) in raw.items()}
    post = state.get("post_processor") or {}
    for processor in post.get("processors", [post]):
        for entry in (processor.get("special_tokens") or {}).values():
            entry["ids"] = [ids_of.get(token, old)
                            for token, old in zip(entry["tokens"], entry["ids"])]
    tokenizer._tokenizer = Tokenizer.from_str(json.dumps(state))
