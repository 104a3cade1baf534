"""Prompts given as input embeddings (enable_prompt_embeds, engine/prompt_embeds.py).

The model's own token embeddings of a prompt, given as prompt_embeds, must give what
the token ids give: the same tokens and logprobs in float32, batched with token prompts,
under chunked prefill, preemption, tensor and pipeline parallelism, truncated; equal
embeddings share prefix-cache blocks and different ones never do. What cannot work is a
clear error. The server's prompt_embeds: tests/entrypoints/test_server_options.py."""

from __future__ import annotations

import base64
import io
import zipfile

import pytest
import torch
from safetensors.torch import load_file

from pagedllm import BeamSearchParams, LLM, PoolingParams, SamplingParams
from pagedllm.engine.prompt_embeds import decode_prompt_embeds
from pagedllm.errors import ConfigError, InvalidRequestError
from pagedllm.models.registry import prompt_embeds_architectures
from tests.utils import random_prompts, save_tiny_model, tiny_llama_config

VOCAB = 256
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_embeds"),
                           tiny_llama_config(vocab_size=VOCAB), seed=5)


@pytest.fixture(scope="module")
def table(tiny_path):
    """The model's token embedding table [vocab, hidden]."""
    return load_file(str(tiny_path / "model.safetensors"))["model.embed_tokens.weight"]


@pytest.fixture(scope="module")
def llm(tiny_path):
    return LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True, block_size=4,
               enable_prompt_embeds=True)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(5, VOCAB, 3, 24, seed=6)


def _embeds(table, ids):
    return {"prompt_embeds": table[torch.tensor(ids)].clone()}


def _same(a, b) -> None:
    """Same tokens, and logprobs equal to float32 rounding."""
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for u, v in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert u.keys() == v.keys()
            assert all(abs(u[t].logprob - v[t].logprob) < 1e-5 for t in u)


def test_embeddings_of_a_prompt_give_what_its_tokens_give(llm, table, prompts):
    by_ids = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    # Alternating with token prompts in one batch.
    mixed = [_embeds(table, p) if i % 2 == 0 else {"prompt_token_ids": p}
             for i, p in enumerate(prompts)]
    out = llm.generate(mixed, GREEDY, use_tqdm=False)
    _same(by_ids, out)
    assert out[0].prompt_token_ids is None and out[1].prompt_token_ids == prompts[1]
    assert [o.num_prompt_tokens for o in out] == [len(p) for p in prompts]
    # A batch of one ([1, tokens, hidden]) is taken too; n > 1 samples alike.
    one = {"prompt_embeds": table[torch.tensor(prompts[0])][None]}
    sampled = SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=6, ignore_eos=True)
    assert ([c.token_ids for c in llm.generate([one], sampled, use_tqdm=False)[0].outputs]
            == [c.token_ids for c in llm.generate([{"prompt_token_ids": prompts[0]}],
                                                  sampled, use_tqdm=False)[0].outputs])


def test_chunked_prefill_preemption_and_truncation(tiny_path, table):
    long_prompts = random_prompts(4, VOCAB, 40, 60, seed=7)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    plain = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True, block_size=4)
    expected = plain.generate([{"prompt_token_ids": p} for p in long_prompts], params,
                              use_tqdm=False)
    # 16-token chunks, and too few blocks for all four at once.
    small = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True, block_size=4,
                enable_prompt_embeds=True, max_num_batched_tokens=16, num_kv_blocks=40,
                enable_prefix_caching=False)
    out = small.generate([_embeds(table, p) for p in long_prompts], params, use_tqdm=False)
    _same(expected, out)
    assert small.llm_engine.engine_core.scheduler.num_preemptions > 0
    # truncate_prompt_tokens keeps the last rows, as it keeps the last tokens.
    cut = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1,
                         truncate_prompt_tokens=10)
    _same(plain.generate([{"prompt_token_ids": long_prompts[0][-10:]}], cut, use_tqdm=False),
          small.generate([_embeds(table, long_prompts[0])], cut, use_tqdm=False))


def test_prefix_cache_keys_on_the_rows(llm, table):
    ids = random_prompts(1, VOCAB, 20, 20, seed=9)[0]
    first = llm.generate([_embeds(table, ids)], GREEDY, use_tqdm=False)[0]
    again = llm.generate([_embeds(table, ids)], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 16
    _same([first], [again])
    # Same length, one row changed after the first block: only that block is shared.
    other = table[torch.tensor(ids)].clone()
    other[5] += 0.5
    changed = llm.generate([{"prompt_embeds": other}], GREEDY, use_tqdm=False)[0]
    assert changed.num_cached_tokens == 0
    # (the embeddings' hash covers the whole prompt: a block with its rows is keyed on
    # all of them, like an image's placeholders on the whole image)


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2},
                                      {"pipeline_parallel_size": 2}])
def test_tensor_and_pipeline_parallel(tiny_path, table, prompts, parallel):
    one = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True,
              enable_prompt_embeds=True)
    expected = one.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                            use_tqdm=False)
    two = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True,
              enable_prompt_embeds=True, **parallel)
    try:
        out = two.generate([_embeds(table, p) for p in prompts], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == \
            [o.outputs[0].token_ids for o in expected]
    finally:
        two.shutdown()


def test_what_cannot_work_is_a_clear_error(tiny_path, llm, table):
    rows = table[:4].clone()

    def refused(prompt, fragment, params=GREEDY, engine=llm):
        with pytest.raises(InvalidRequestError, match=fragment):
            engine.generate([prompt], params, use_tqdm=False)

    refused({"prompt_embeds": rows[:, :10]}, r"shape \[tokens, 64\].*got \[4, 10\]")
    refused({"prompt_embeds": torch.zeros(2, 4, 64)}, r"got \[2, 4, 64\]")
    refused({"prompt_embeds": rows.long()}, "must be floating point")
    refused({"prompt_embeds": rows[:0]}, "is empty")
    refused({"prompt_embeds": rows.tolist()}, "must be a dense torch.Tensor")
    refused({"prompt_embeds": rows.to_sparse()}, "must be a dense torch.Tensor")
    nan = rows.clone()
    nan[1, 2] = float("nan")
    refused({"prompt_embeds": nan}, "NaN or infinite")
    refused({"prompt_embeds": torch.zeros(300, 64)}, "longer than the maximum model length")
    refused({"prompt_embeds": rows, "prompt_token_ids": [1]}, "not both")
    refused({"prompt_embeds": rows},
            "prompt_logprobs needs a prompt of tokens",
            SamplingParams(max_tokens=2, prompt_logprobs=1))
    refused({"prompt_embeds": rows}, "repetition_penalty counts the prompt",
            SamplingParams(max_tokens=2, repetition_penalty=1.2))
    with pytest.raises(InvalidRequestError, match="prompt_embeds in embedding"):
        llm.embed([{"prompt_embeds": rows}], use_tqdm=False, pooling_params=PoolingParams())
    with pytest.raises(InvalidRequestError, match="not prompt_embeds"):
        llm.beam_search([{"prompt_embeds": rows}], BeamSearchParams(beam_width=2,
                                                                     max_tokens=2))
    plain = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True)
    refused({"prompt_embeds": rows}, "enable_prompt_embeds=True", engine=plain)


def test_engines_that_cannot_take_them_refuse_at_start(tiny_path, tmp_path):
    from transformers import GPT2Config

    gpt2 = save_tiny_model(tmp_path / "gpt2", GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128))
    with pytest.raises(ConfigError, match="GPT2LMHeadModel does not take input "
                                          "embeddings"):
        LLM(str(gpt2), skip_tokenizer_init=True, enable_prompt_embeds=True)
    assert "LlamaForCausalLM" in prompt_embeds_architectures()
    with pytest.raises(ConfigError, match="speculative decoding"):
        LLM(str(tiny_path), skip_tokenizer_init=True, enable_prompt_embeds=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def _saved(value, **kw) -> str:
    buf = io.BytesIO()
    torch.save(value, buf, **kw)
    return base64.b64encode(buf.getvalue()).decode()


def test_the_api_form_loads_only_plain_dense_tensors():
    rows = torch.randn(3, 8)
    assert torch.equal(decode_prompt_embeds(_saved(rows)), rows)
    for data, fragment in (
            ("not base64!", "not valid base64"),
            (_saved({"x": rows}), "must hold one tensor, got dict"),
            (_saved(rows, _use_new_zipfile_serialization=False), "its zip format"),
            (base64.b64encode(b"\x00" * 64).decode(), "its zip format")):
        with pytest.raises(InvalidRequestError, match=fragment):
            decode_prompt_embeds(data)
    # An archive that would inflate (torch.save stores its entries as they are).
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data/0", b"\x00" * 1_000_000)
    with pytest.raises(InvalidRequestError, match="is compressed"):
        decode_prompt_embeds(base64.b64encode(buf.getvalue()).decode())
    # A sparse tensor whose indices point outside it fails as it loads.
    bad = torch.sparse_coo_tensor(torch.tensor([[0, 9]]), torch.ones(2), (3,),
                                  check_invariants=False)
    with pytest.raises(InvalidRequestError, match="not a tensor saved with torch.save"):
        decode_prompt_embeds(_saved(bad))
