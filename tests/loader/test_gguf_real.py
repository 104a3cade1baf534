"""The bundled SmolLM2-135M-Instruct Q4_1 GGUF against transformers' own GGUF loading.

Equal tensors here are the check that the llama q/k un-permutation is right on a real
llama.cpp file (9 query heads, 3 KV heads, Q4_1 + Q8_0 + F32 tensors, tied embeddings).
Slow (transformers dequantizes the whole file), but part of the default suite.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedllm.config import default_model_path
from pagedllm.loader import iter_weights, load_tokenizer
from pagedllm.loader import gguf as gguf_loader
from pagedllm.loader.gguf import GGUFWeights
from pagedllm.loader.gguf_cache import TOKENIZER_DIR, entry_dir, load_gguf_config

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello, world!",
    "  leading spaces, tabs\tand\nnewlines  ",
    "Ünïcödé: 日本語のテキスト, emoji 🙂, accents café",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
    "def f(x):\n    return x ** 2  # code",
]


@pytest.fixture(scope="module")
def real_path() -> Path:
    return Path(default_model_path())


@pytest.fixture(scope="module")
def hf_state(real_path) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(real_path.parent, gguf_file=real_path.name,
                                                 dtype=torch.float32)
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_weights_equal_transformers_gguf_loading(real_path, hf_state):
    ours = dict(GGUFWeights(str(real_path)).iter_weights(torch.float32))
    # Tied embeddings: the file has no output.weight; transformers' lm_head is embed_tokens.
    assert "lm_head.weight" not in ours
    assert set(ours) == set(hf_state) - {"lm_head.weight"}
    assert len(ours) == 272
    for name, tensor in ours.items():
        assert tensor.shape == hf_state[name].shape, name
        assert torch.equal(tensor, hf_state[name]), name
    assert torch.equal(hf_state["lm_head.weight"], ours["model.embed_tokens.weight"])


def test_fast_reader_parses_what_gguf_py_parses(real_path):
    """open_reader's reader (also transformers' within transformers_parse_fast) gives every
    field (the 49k-token vocabulary and merges included) and tensor as gguf-py's own does."""
    ref, ours = gguf.GGUFReader(str(real_path)), gguf_loader.open_reader(str(real_path))
    assert not isinstance(ours.data, np.memmap) and np.array_equal(ours.data, ref.data)
    assert list(ours.fields) == list(ref.fields)
    for name, f in ref.fields.items():
        g = ours.fields[name]
        assert (g.name, g.offset, g.types, g.data) == (f.name, f.offset, f.types, f.data), name
        assert len(g.parts) == len(f.parts), name
        assert all(a.dtype == b.dtype and np.array_equal(a, b)
                   for a, b in zip(g.parts, f.parts)), name
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in ours.tensors] \
        == [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in ref.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, ref.tensors))


def test_cached_stream_equals_transformers(real_path, hf_state, monkeypatch):
    first = dict(iter_weights(str(real_path), None, torch.bfloat16))
    assert (entry_dir(str(real_path)) / "weights-bfloat16.safetensors").is_file()

    def boom(*args, **kwargs):
        raise AssertionError("GGUF parsed although the cache should serve")

    monkeypatch.setattr(gguf.GGUFReader, "__init__", boom)  # every parse: ours, transformers'
    second = dict(iter_weights(str(real_path), None, torch.bfloat16))
    assert set(first) == set(second) == set(hf_state) - {"lm_head.weight"}
    for name, ref in hf_state.items():
        if name != "lm_head.weight":
            assert torch.equal(first[name], ref.to(torch.bfloat16)), name
            assert torch.equal(second[name], first[name]), name


def test_config_from_gguf_and_cache(real_path):
    first = load_gguf_config(str(real_path))
    assert (first.model_type, first.architectures) == ("llama", ["LlamaForCausalLM"])
    assert (first.num_hidden_layers, first.hidden_size) == (30, 576)
    assert (first.num_attention_heads, first.num_key_value_heads) == (9, 3)
    assert first.tie_word_embeddings
    second = load_gguf_config(str(real_path))  # served from the cache directory
    assert second.to_dict() == first.to_dict()


def test_tokenizer_matches_transformers(real_path, request):
    """Our first (parsed) and second (cached) tokenizer against transformers' own; the
    first load's header parse, transformers' own, goes through the plain-ndarray reader."""
    ref = AutoTokenizer.from_pretrained(real_path.parent, gguf_file=real_path.name)
    memmapped = request.getfixturevalue("memmapped_readers")  # from here on, not ref's
    first = load_tokenizer(str(real_path))
    assert memmapped == [False]  # one parse (transformers'), on the fast reader
    assert (entry_dir(str(real_path)) / TOKENIZER_DIR).is_dir()
    second = load_tokenizer(str(real_path))  # served from the cache directory
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ref_chat = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    for tok in (first, second):
        assert tok.chat_template and tok.chat_template == ref.chat_template
        assert (tok.bos_token_id, tok.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
        assert tok.apply_chat_template(messages, tokenize=False,
                                       add_generation_prompt=True) == ref_chat
        for text in TEXTS + [ref_chat]:
            ids = tok(text).input_ids
            assert ids == ref(text).input_ids, text
            assert tok.decode(ids) == ref.decode(ids), text
