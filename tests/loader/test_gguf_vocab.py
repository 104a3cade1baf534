"""Real tokenizers from GGUF metadata: llama.cpp's vocab-only files (see `vocab_files`).

pagedllm's tokenizer (`load_tokenizer(path.gguf)`, served from its conversion cache) is
transformers' `AutoTokenizer.from_pretrained(dir, gguf_file=name)` with the changes of
gguf_vocab.py, where transformers splits text otherwise than llama.cpp. Checked per
vocabulary:
- it encodes and decodes a few hundred generated strings exactly like transformers' own
  (the vocabularies gguf_vocab.py changes: decodes alike; the pipelines differ in the
  changed parts only);
- it reproduces llama.cpp's reference token ids (`.gguf.inp` / `.gguf.out`, made with the
  model's original HF tokenizer and checked against llama.cpp's own);
- for the vocabularies gguf_vocab.py changes, it reproduces the ids llama.cpp's own
  tokenizer gives the generated strings and stretches of text around special tokens
  (data/llama_cpp_ids.json, recorded with llama-tokenize).
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pagedllm.loader import load_tokenizer
from pagedllm.loader.gguf_cache import TOKENIZER_DIR, entry_dir
from pagedllm.loader.gguf_vocab import PRE_SPLITS
from tests.loader.vocab_files import VocabDownloadError, reference_tests, vocab_dir

# qwen35 (a Qwen2 vocabulary with Qwen3.5's split regex, no normalizer) guards the cache
# round trip: reloading it through its architecture's class used to swap the pipeline.
VOCABS = ["gpt-2", "qwen2", "qwen35", "phi-3", "llama-bpe", "llama-spm", "deepseek-llm",
          "deepseek-coder"]
NUM_TEXTS = 300

# The vocabularies gguf_vocab.py changes, and what it changes in each one's pipeline.
CHANGED = {"llama-spm": "normalizer", "phi-3": "rstrip", "llama-bpe": "ignore_merges",
           "deepseek-llm": "split", "deepseek-coder": "split"}
LLAMA_CPP_IDS = Path(__file__).parent / "data" / "llama_cpp_ids.json"
# (vocab, text) where pagedllm keeps to tokenizers' behaviour rather than llama.cpp's:
# llama.cpp strips only ASCII whitespace after Phi-3's special tokens, Phi-3's own
# tokenizer.json (rstrip) any Unicode whitespace, here a no-break space.
# And llama.cpp's regex engine makes U+3000 a piece of its own after two spaces, where
# tokenizers' (Oniguruma) leaves it with the second (not checked against DeepSeek's own
# tokenizer.json: not available offline; llama.cpp's 46 reference texts all match).
LLAMA_CPP_OWN = {("phi-3", "I'm 🦙 ID\t<|user|>\xa0  "),
                 ("deepseek-llm", "def f(x):\n    return x ** 2  ภาษาไทย3.14159  \u3000"
                                  "...Zürich, I'm...")}

# vocab -> ids that transformers' freshly converted GGUF tokenizer skips in
# decode(skip_special_tokens=True) although the file marks them USER_DEFINED (llama.cpp's
# converter writes that for added tokens not marked special): building the backend from
# scratch registers the default eos `</s>` as special, and re-adding it as a plain token
# clears the flag it serializes but not the one its in-memory backend decodes with.
# pagedllm serves the saved-and-reloaded tokenizer, which keeps the token as the file says.
STALE_SPECIAL_IDS = {"phi-3": {2}}


@pytest.fixture(scope="session")
def vocab_files() -> Path:
    """The unpacked vocab files; downloaded once into the test-data cache."""
    try:
        return vocab_dir()
    except VocabDownloadError as e:
        error = str(e)
    pytest.fail(f"llama.cpp vocab files unavailable: {error}", pytrace=False)


@pytest.fixture(scope="session")
def tokenizer_pairs(vocab_files) -> Callable[[str], tuple[Any, Any]]:
    """vocab -> (transformers' own GGUF tokenizer, pagedllm's served tokenizer), memoized."""
    memo: dict[str, tuple[Any, Any]] = {}

    def get(vocab: str) -> tuple[Any, Any]:
        if vocab not in memo:
            memo[vocab] = _load_pair(vocab_files / f"ggml-vocab-{vocab}.gguf")
        return memo[vocab]

    return get


def _load_pair(path: Path) -> tuple[Any, Any]:
    """Parsing a vocabulary takes seconds (10-17 s for 150k tokens on 2 cores), so it is
    parsed once: pagedllm's first load calls `AutoTokenizer.from_pretrained(dir,
    gguf_file=name)` (its header parsed by `open_reader`'s reader, which test_gguf_real
    checks field by field against gguf-py's own); that call's result is kept as the
    reference (pagedllm gets a deep copy to cache). pagedllm serves its cached copy from
    the first load on; the second load reads only the cache."""
    from transformers import AutoTokenizer

    real = AutoTokenizer.from_pretrained
    captured = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        tok = real(*args, **kwargs)
        if kwargs.get("gguf_file") is None:
            return tok
        captured.append(tok)
        return copy.deepcopy(tok)

    assert not (entry_dir(str(path)) / TOKENIZER_DIR).exists()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(AutoTokenizer, "from_pretrained", spy)
        first = load_tokenizer(str(path))
    assert len(captured) == 1 and (entry_dir(str(path)) / TOKENIZER_DIR).is_dir()
    served = load_tokenizer(str(path))
    assert first is not captured[0] and type(first) is type(served)
    assert first.backend_tokenizer.to_str() == served.backend_tokenizer.to_str()
    return captured[0], served


_WORDS = ["Hello", "world", "the", "quick", "brown", "fox", "don't", "I'm", "you'll", "HTTP",
          "naïve", "café", "straße", "Zürich", "São", "Paulo", "coöperate", "résumé", "ID"]
_UNICODE = ["日本語のテキスト", "中文字符", "한국어 문장", "Привет, мир", "مرحبا بالعالم",
            "नमस्ते दुनिया", "Γειά σου Κόσμε", "שלום עולם", "ภาษาไทย", "Tiếng Việt", "Cửa Việt",
            "ﬁ ligature", "A\u030a vs \u00c5", "re\u0301sume\u0301", "½ ¾ ⅓", "µ vs μ",
            "€100", "™®©", "…—–", "ℌ𝔢𝔩𝔩𝔬"]
_EMOJI = ["🙂", "🦙", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷", "❤️", "🤖🤖🤖", "⭐", "😁 ?"]
_CODE = ["def f(x):\n    return x ** 2", "for (int i = 0; i < n; ++i) { a[i] += 1; }",
         '{"key": [1, 2.5, null], "ok": true}', "SELECT * FROM t WHERE id = 42;",
         "x = y if y else None  # comment", "<div class=\"a\">&amp;</div>",
         "fn main() -> Result<(), Box<dyn Error>> {}", "$ ls -la | grep '.py$'"]
_SPACES = [" ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", " \n ", "    ", "\n    ",
           "\u00a0", "\u3000", "  \t  "]
_NUMBERS = ["0", "7", "42", "1234567890", "3.14159", "-273.15", "1,000,000", "1e-9", "0x1F",
            "2024-01-31", "12:30:45", "99.9%", "١٢٣", "①②③"]
_SPECIAL = ["<|endoftext|>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>",
            "<|user|>", "<|begin_of_text|>"]


def sample_texts(n: int = NUM_TEXTS, seed: int = 0) -> list[str]:
    """`n` deterministic test strings: a few fixed edge cases, then random joins of words,
    scripts, emoji, code, whitespace runs, numbers, special-token spellings and random
    code points, with random separators and leading/trailing whitespace."""
    rng = random.Random(seed)
    pools = [_WORDS, _WORDS, _UNICODE, _EMOJI, _CODE, _SPACES, _NUMBERS, _SPECIAL]
    texts = ["", " ", "a", "  leading", "trailing  ", "\n\nnewlines\n\n", "x" * 300,
             " ".join(_WORDS), "".join(_EMOJI), "\t".join(_NUMBERS)]
    while len(texts) < n:
        parts = []
        for _ in range(rng.randint(1, 6)):
            if rng.random() < 0.1:  # random BMP / astral code points (no surrogates)
                parts.append("".join(chr(rng.choice([rng.randint(0x20, 0xD7FF),
                                                     rng.randint(0xE000, 0x10FFFF)]))
                                     for _ in range(rng.randint(1, 4))))
            else:
                parts.append(rng.choice(rng.choice(pools)))
            parts.append(rng.choice(["", " ", " ", "  ", "\n", ", ", "\t", "..."]))
        texts.append("".join(parts).rstrip(rng.choice(["", " \n"])))
    return texts


@pytest.mark.parametrize("vocab", VOCABS)
def test_matches_transformers(vocab_files, tokenizer_pairs, vocab):
    """Generated texts and llama.cpp's reference texts: encoded alike where gguf_vocab.py
    changes nothing, decoded alike everywhere."""
    ref, ours = tokenizer_pairs(vocab)
    got, expected = _pipeline(ours), _expected_pipeline(ref, vocab)
    if CHANGED.get(vocab) == "split":  # the added tokens too: test_deepseek_added_tokens
        for state in (got, expected):
            del state["added_tokens"], state["post_processor"], state["model"]["vocab"]
    assert got == expected
    assert ours.chat_template == ref.chat_template
    if CHANGED.get(vocab) != "split":
        foreign = 1 if CHANGED.get(vocab) == "ignore_merges" else 0  # "<|endoftext|>"
        assert (ours.bos_token_id, ours.eos_token_id, len(ours)) == (
            ref.bos_token_id, ref.eos_token_id, len(ref) - foreign)
    texts = sample_texts() + [text for text, _ in
                              reference_tests(vocab_files / f"ggml-vocab-{vocab}.gguf")]
    stale = STALE_SPECIAL_IDS.get(vocab, set())
    if vocab in DEEPSEEK:  # special to pagedllm, plain (byte-spelled) to transformers
        stale = stale | set(ours.all_special_ids)
    for text in texts:
        for add_special in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special)
            if vocab not in CHANGED:
                assert ids == ref.encode(text, add_special_tokens=add_special), (text,
                                                                                 add_special)
            assert ours.decode(ids) == ref.decode(ids), text
            kept = [i for i in ids if i not in stale]
            assert ours.decode(kept, skip_special_tokens=True) == ref.decode(
                kept, skip_special_tokens=True), text


# vocab -> (BOS, EOS, size) in the file, and llama.cpp's ids (llama-tokenize, BOS added)
# of BOS's and EOS's own text around "hi", then "x".
DEEPSEEK = {"deepseek-coder": ((32013, 32014, 32256), [32013, 32013, 4821, 32014, 87]),
            "deepseek-llm": ((100000, 100001, 102400), [100000, 100000, 4824, 100001, 87])}


@pytest.mark.parametrize("vocab", list(DEEPSEEK))
def test_deepseek_added_tokens(tokenizer_pairs, vocab):
    """DeepSeek's control tokens ("<｜begin▁of▁sentence｜>": not in the byte alphabet) keep
    their text and ids: transformers spelled them as bytes and added BOS / EOS again past
    the vocabulary, so every prompt began with an id the model does not have."""
    ref, ours = tokenizer_pairs(vocab)
    (bos, eos, size), ids = DEEPSEEK[vocab]
    assert (ours.bos_token_id, ours.eos_token_id, len(ours)) == (bos, eos, size)
    assert ref.bos_token_id >= size  # what transformers gives
    text = f"{ours.bos_token}hi{ours.eos_token}x"
    assert ours.encode(text) == ids
    assert ours.decode(ids, skip_special_tokens=True) == "hix"
    assert ours.decode(ids[1:]) == text


def _pipeline(tokenizer: Any) -> dict[str, Any]:
    return json.loads(tokenizer.backend_tokenizer.to_str())


def _expected_pipeline(ref: Any, vocab: str) -> dict[str, Any]:
    """transformers' pipeline with gguf_vocab.py's change for the vocabulary, spelled out
    here (tokenizers' JSON form; the split expressions are gguf_vocab.py's)."""
    state, change = _pipeline(ref), CHANGED.get(vocab)
    if change == "normalizer":  # sentencepiece: a prefix space before every stretch
        state["normalizer"] = {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u2581"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
        state["pre_tokenizer"] = None
    elif change == "rstrip":  # Phi-3: special tokens strip the whitespace after them
        for token in state["added_tokens"]:
            token["rstrip"] = token["content"] not in ("<unk>", "<s>", "<|endoftext|>")
    elif change == "ignore_merges":  # Llama 3: whole pre-tokens first; no foreign token
        state["model"]["ignore_merges"] = True
        assert [t["content"] for t in state["added_tokens"] if t["id"] >= 128256] == [
            "<|endoftext|>"]
        state["added_tokens"] = [t for t in state["added_tokens"] if t["id"] < 128256]
    elif change == "split":  # llama.cpp's split expressions, then byte-level
        assert state["pre_tokenizer"]["type"] == "ByteLevel"  # GPT-2's one expression
        state["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            *({"type": "Split", "pattern": {"Regex": expr}, "behavior": "Isolated",
               "invert": False} for expr in PRE_SPLITS[vocab]),
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": False}]}
    return state


def test_user_defined_token_kept_when_skipping_special(tokenizer_pairs):
    """See STALE_SPECIAL_IDS: pagedllm keeps Phi-3's `</s>` (USER_DEFINED in the file) when
    skipping special tokens; transformers' in-memory object drops it (the upstream quirk,
    asserted so that a change there is noticed)."""
    ref, ours = tokenizer_pairs("phi-3")
    assert ours.convert_ids_to_tokens(2) == "</s>" and 2 not in ours.all_special_ids
    assert ours.decode([1, 2, 450], skip_special_tokens=True) == "</s> The"
    assert ref.decode([1, 2, 450], skip_special_tokens=True) == "The"


@pytest.mark.parametrize("vocab", VOCABS)
def test_llama_cpp_reference_ids(vocab_files, tokenizer_pairs, vocab):
    _, ours = tokenizer_pairs(vocab)
    cases = reference_tests(vocab_files / f"ggml-vocab-{vocab}.gguf")
    assert len(cases) >= 30
    bad = [(text, ids, got) for text, ids in cases
           if (got := ours.encode(text, add_special_tokens=False)) != ids]
    assert not bad, "\n".join(f"{t!r}: expected {e}, got {g}" for t, e, g in bad)


@pytest.mark.parametrize("vocab", list(CHANGED))
def test_llama_cpp_ids_of_generated_texts(tokenizer_pairs, vocab):
    """The ids llama.cpp's tokenizer gave the generated texts and texts around special
    tokens ("<s>[INST] Hi [/INST]", "Hello</s>World", "<|user|>\\nHi<|end|>", ...), where
    transformers' conversion departs from it (each vocabulary: 18-59 of the 316)."""
    ref, ours = tokenizer_pairs(vocab)
    recorded = json.loads(LLAMA_CPP_IDS.read_text())["ids"][vocab]
    texts = [text for text, _ in recorded]
    assert set(sample_texts()) < set(texts)  # each once, then the special-token stretches
    bad = [(text, ids, got) for text, ids in recorded
           if (got := ours.encode(text, add_special_tokens=False)) != ids
           and (vocab, text) not in LLAMA_CPP_OWN]
    assert not bad, "\n".join(f"{t!r}: expected {e}, got {g}" for t, e, g in bad)
    assert sum(ref.encode(text, add_special_tokens=False) != ids
               for text, ids in recorded) >= 10  # the change is what makes them match
