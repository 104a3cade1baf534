"""Bad input gets a clear ValueError naming the limit and the value, and loses nothing."""

from __future__ import annotations

import json

import pytest
from transformers import LlamaConfig

from pagedllm import LLM, EngineArgs, InvalidRequestError, LLMEngine, SamplingParams
from pagedllm.errors import ConfigError, ModelLoadError
from tests.utils import random_prompts, save_tiny_model


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=128, eos_token_id=None, bos_token_id=None)
    return save_tiny_model(tmp_path_factory.mktemp("tiny_bad"), cfg)


@pytest.fixture(scope="module")
def llm(tiny_path):
    # 64 tokens max; 8 blocks of 4 tokens -> 7 usable blocks = 28 tokens of cache.
    return LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True, max_model_len=64,
               block_size=4, num_kv_blocks=8)


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": 1e300}, "temperature"), ({"top_k": 2**40}, "top_k"),
    ({"min_tokens": 2**40}, "min_tokens"), ({"logprobs": 2**40}, "logprobs")])
def test_sampling_params_validated(kwargs, field):
    with pytest.raises(ValueError, match=field) as e:
        SamplingParams(**kwargs)
    assert str(list(kwargs.values())[0]) in str(e.value)


def test_prompt_longer_than_max_model_len(llm):
    with pytest.raises(InvalidRequestError, match=r"length 65\).*maximum model length of 64"):
        llm.generate([{"prompt_token_ids": [1] * 65}], use_tqdm=False)


def test_prompt_larger_than_kv_cache(llm):
    # 40 tokens need 10 blocks of 4; the cache has 7 usable.
    with pytest.raises(InvalidRequestError, match=r"40.*10.*7"):
        llm.generate([{"prompt_token_ids": [1] * 40}], use_tqdm=False)


def test_empty_prompt(llm):
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], use_tqdm=False)


def test_token_id_out_of_vocab(llm):
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        llm.generate([{"prompt_token_ids": [5, 128]}], use_tqdm=False)


def test_bad_prompt_in_generate_leaves_engine_clean(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": []}], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(max_tokens=3),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_one_bad_request_does_not_lose_others(tiny_path):
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=str(tiny_path), dtype="float32", max_model_len=64),
        skip_tokenizer_init=True)
    params = SamplingParams(temperature=0, max_tokens=5)
    good = random_prompts(4, 128, 2, 10)
    accepted = []
    for i, prompt in enumerate(good[:2] + [[1] * 100] + good[2:] + [[]]):
        try:
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
            accepted.append(str(i))
        except InvalidRequestError:
            pass
    assert accepted == ["0", "1", "3", "4"]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert sorted(done) == accepted
    assert all(len(o.outputs[0].token_ids) == 5 for o in done.values())


def test_abort_request(tiny_path):
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=str(tiny_path), dtype="float32"), skip_tokenizer_init=True)
    engine.add_request("a", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=50))
    engine.add_request("b", {"prompt_token_ids": [4, 5]}, SamplingParams(max_tokens=3))
    engine.step()
    outs = engine.abort_request("a")
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    kv = engine.engine_core.scheduler.kv_cache_manager
    assert kv.block_pool.get_num_free_blocks() == engine.engine_core.num_blocks - 1


def test_model_path_missing():
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM("/nonexistent/model/dir")


def test_unsupported_architecture(tmp_path, tiny_path):
    cfg = json.loads((tiny_path / "config.json").read_text())
    cfg["architectures"] = ["MadeUpForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="MadeUpForCausalLM.*LlamaForCausalLM"):
        LLM(str(tmp_path), skip_tokenizer_init=True)


def test_cuda_without_a_gpu_names_the_device(tiny_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="device 'cuda' was requested but no CUDA GPU"):
        EngineArgs(model=str(tiny_path), device="cuda").create_engine_config()


@pytest.mark.parametrize("dtype, expected", [("half", "float16"), ("float", "float32"),
                                             ("float16", "float16"),
                                             ("torch.bfloat16", "bfloat16")])
def test_dtype_takes_vllms_names(tiny_path, dtype, expected):
    """vLLM's dtype names (half, float) and torch dtypes name the same dtypes."""
    import torch

    if dtype.startswith("torch."):
        dtype = getattr(torch, dtype.removeprefix("torch."))
    config = EngineArgs(model=str(tiny_path), dtype=dtype).create_engine_config()
    assert config.model.dtype == expected


def test_unknown_dtype_is_refused_by_name(tiny_path):
    import torch

    for dtype in ("double", torch.int8):
        with pytest.raises(ValueError, match="dtype must be one of .*half"):
            EngineArgs(model=str(tiny_path), dtype=dtype).create_engine_config()


def test_tokenizer_mode_and_guided_backend_take_what_pagedllm_runs(tiny_path):
    """auto and hf (vLLM's names of transformers' tokenizer) are accepted; slow, mistral
    and custom, which pagedllm cannot honour, are refused by name."""
    for mode in ("auto", "hf"):
        EngineArgs(model=str(tiny_path), tokenizer_mode=mode).create_engine_config()
    for mode in ("slow", "mistral", "custom"):
        with pytest.raises(ValueError, match=f"tokenizer_mode must be one of .*'{mode}'"):
            EngineArgs(model=str(tiny_path), tokenizer_mode=mode).create_engine_config()
    # vLLM's --guided-decoding-backend: xgrammar (what pagedllm runs) or auto.
    EngineArgs(model=str(tiny_path), guided_decoding_backend="xgrammar").create_engine_config()
    with pytest.raises(ValueError, match="guided_decoding_backend must be one of .*outlines"):
        EngineArgs(model=str(tiny_path),
                   guided_decoding_backend="outlines").create_engine_config()


def test_runner_restricts_what_requests_the_engine_takes(tiny_path, tmp_path):
    """vLLM's --runner (and its older --task): pooling takes no generation, generate
    no pooling, each refused by name; auto takes both (a decoder embeds too)."""
    from pagedllm import PoolingParams
    from tests.utils import save_tiny_bert

    prompt = [{"prompt_token_ids": [1, 2, 3]}]
    greedy = SamplingParams(max_tokens=2, temperature=0)
    for kwargs in ({"runner": "pooling"}, {"task": "embed"}):
        llm = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True, **kwargs)
        assert len(llm.embed(prompt, use_tqdm=False)[0].outputs.embedding) == 32
        with pytest.raises(InvalidRequestError, match="runner 'pooling' .*no generation"):
            llm.generate(prompt, greedy, use_tqdm=False)
    for kwargs in ({"runner": "generate"}, {"task": "generate"}):
        llm = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True, **kwargs)
        assert len(llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids) == 2
        with pytest.raises(InvalidRequestError, match="runner 'generate' .*no pooling"):
            llm.embed(prompt, PoolingParams(), use_tqdm=False)
    auto = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True)
    auto.embed(prompt, use_tqdm=False), auto.generate(prompt, greedy, use_tqdm=False)
    with pytest.raises(ValueError, match="task 'embed' and runner 'generate' disagree"):
        EngineArgs(model=str(tiny_path), runner="generate", task="embed").create_engine_config()
    with pytest.raises(ValueError, match="runner must be one of"):
        EngineArgs(model=str(tiny_path), runner="draft").create_engine_config()
    bert = save_tiny_bert(tmp_path / "bert")
    with pytest.raises(ValueError, match="runner 'generate': BertModel cannot generate"):
        EngineArgs(model=str(bert), runner="generate").create_engine_config()


def test_long_prefill_threshold_defaults_and_refusals(tiny_path):
    def threshold(**kw) -> int:
        config = EngineArgs(model=str(tiny_path), max_model_len=256,
                            **kw).create_engine_config()
        return config.scheduler.long_prefill_token_threshold

    # A quarter of the step's budget (256 tokens at least), vLLM's 4% of max_model_len
    # with partial prefills, what is given, or none without chunked prefill.
    assert threshold() == 512
    assert threshold(max_num_batched_tokens=4096) == 1024
    assert threshold(max_num_batched_tokens=300) == 256
    assert threshold(max_num_batched_tokens=64) == 64
    assert threshold(max_num_partial_prefills=4) == int(256 * 0.04)
    assert threshold(long_prefill_token_threshold=0) == 0
    assert threshold(long_prefill_token_threshold=100) == 100
    assert threshold(enable_chunked_prefill=False) == 0
    for kw, fragment in (({"long_prefill_token_threshold": -1}, "must be >= 0"),
                         ({"max_num_partial_prefills": 0}, "must be >= 1"),
                         ({"long_prefill_token_threshold": 8,
                           "enable_chunked_prefill": False}, "needs chunked prefill")):
        with pytest.raises(ConfigError, match=fragment):
            threshold(**kw)
