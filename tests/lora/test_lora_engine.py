"""LoRA adapters per request: the engine against transformers computing PEFT's unmerged
LoRA (forward hooks: y += scale (x A^T) B^T), outputs independent of what shares the
step, the prefix cache kept per adapter, adapters dropped and reloaded, n > 1."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, LoRARequest, SamplingParams
from tests.utils import (apply_lora_hooks, hf_greedy_no_eos, random_prompts, save_tiny_lora,
                         save_tiny_model, tiny_llama_config)

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model = save_tiny_model(root / "model", tiny_llama_config())
    # Every linear at rank 4; q and v only at rank 8 with rsLoRA scaling.
    full = save_tiny_lora(root / "full", model, seed=1)
    qv = save_tiny_lora(root / "qv", model, rank=8, alpha=4.0, targets=("q_proj", "v_proj"),
                        seed=2, use_rslora=True)
    return model, full, qv


def _ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _hf_reference(model_path, adapter, prompts):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    handles = apply_lora_hooks(hf, adapter) if adapter is not None else []
    try:
        tokens = [hf_greedy_no_eos(hf, p, MAX_TOKENS) for p in prompts]
        with torch.no_grad():
            logprobs = [torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1)
                        for p in prompts]
    finally:
        for h in handles:
            h.remove()
    return tokens, logprobs


def test_adapters_match_transformers_in_one_batch(tiny):
    """Base, both adapters and each prompt in one generate call (mixed steps, float32):
    transformers' greedy tokens, and prompt logprobs within 1e-4."""
    model, full, qv = tiny
    prompts = random_prompts(4, 256, 5, 20, seed=3)
    llm = LLM(str(model), skip_tokenizer_init=True, dtype="float32", enable_lora=True,
              max_loras=2)
    loras = [None, LoRARequest("full", 1, str(full)), LoRARequest("qv", 2, str(qv))]
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                        prompt_logprobs=0)
    outs = llm.generate(_ids(prompts * 3), sp, use_tqdm=False,
                        lora_request=[lora for lora in loras for _ in prompts])
    refs = {}
    for k, (lora, adapter) in enumerate(zip(loras, (None, full, qv))):
        tokens, logprobs = _hf_reference(model, adapter, prompts)
        refs[k] = tokens
        got = outs[k * len(prompts):(k + 1) * len(prompts)]
        assert _tokens(got) == tokens, lora
        for out, prompt, ref in zip(got, prompts, logprobs):
            for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
                want = float(ref[pos - 1, prompt[pos]])
                assert abs(entry[prompt[pos]].logprob - want) < 1e-4, (lora, pos)
    # Not vacuous: each adapter changes the greedy tokens.
    assert refs[1] != refs[0] and refs[2] != refs[0] and refs[1] != refs[2]


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2},
                                      {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_adapters_with_tensor_and_pipeline_parallelism(tiny, parallel):
    """Two worker processes: each rank keeps its rows of B (column-parallel layers) or
    its columns of A (row-parallel: its partial delta joins the all-reduce); each stage
    its layers' adapters. transformers' greedy tokens and prompt logprobs within 1e-4,
    as with one worker."""
    model, full, qv = tiny
    prompts = random_prompts(3, 256, 5, 20, seed=3)
    llm = LLM(str(model), skip_tokenizer_init=True, dtype="float32", enable_lora=True,
              max_loras=2, **parallel)
    try:
        loras = [None, LoRARequest("full", 1, str(full)), LoRARequest("qv", 2, str(qv))]
        sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                            prompt_logprobs=0)
        outs = llm.generate(_ids(prompts * 3), sp, use_tqdm=False,
                            lora_request=[lora for lora in loras for _ in prompts])
    finally:
        llm.shutdown()
    for k, adapter in enumerate((None, full, qv)):
        tokens, logprobs = _hf_reference(model, adapter, prompts)
        got = outs[k * len(prompts):(k + 1) * len(prompts)]
        assert _tokens(got) == tokens, adapter
        for out, prompt, ref in zip(got, prompts, logprobs):
            for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
                assert abs(entry[prompt[pos]].logprob - float(ref[pos - 1, prompt[pos]])) < 1e-4


def test_outputs_do_not_depend_on_the_batch(tiny):
    """Default dtype, native kernels: a request's tokens and logprobs are the same bits
    alone and beside base and other-adapter requests, with chunked prefill (a small
    token budget) and prefix-cache hits in play."""
    model, full, qv = tiny
    llm = LLM(str(model), skip_tokenizer_init=True, enable_lora=True, max_loras=2,
              max_num_batched_tokens=24)
    prompts = random_prompts(6, 256, 10, 40, seed=4)
    loras = [LoRARequest("full", 1, str(full)), None, LoRARequest("qv", 2, str(qv))] * 2
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
    mixed = llm.generate(_ids(prompts), sp, use_tqdm=False, lora_request=loras)
    for prompt, lora, out in zip(prompts, loras, mixed):
        alone = llm.generate(_ids([prompt]), sp, use_tqdm=False, lora_request=lora)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids, lora
        assert alone.outputs[0].logprobs == out.outputs[0].logprobs, lora


def test_prefix_cache_is_kept_per_adapter(tiny):
    model, full, qv = tiny
    llm = LLM(str(model), skip_tokenizer_init=True, enable_lora=True, max_loras=2)
    prompt = _ids(random_prompts(1, 256, 64, 64, seed=5))
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    a, b = LoRARequest("full", 1, str(full)), LoRARequest("qv", 2, str(qv))
    assert llm.generate(prompt, sp, use_tqdm=False, lora_request=a)[0].num_cached_tokens == 0
    # The same adapter hits its blocks; another adapter and the base model do not.
    assert llm.generate(prompt, sp, use_tqdm=False, lora_request=a)[0].num_cached_tokens > 0
    assert llm.generate(prompt, sp, use_tqdm=False, lora_request=b)[0].num_cached_tokens == 0
    assert llm.generate(prompt, sp, use_tqdm=False)[0].num_cached_tokens == 0


def test_adapters_are_dropped_and_reloaded(tiny):
    """max_cpu_loras=1: each switch drops the loaded adapter; the outputs stay the same."""
    model, full, qv = tiny
    llm = LLM(str(model), skip_tokenizer_init=True, enable_lora=True, max_loras=1,
              max_cpu_loras=1, enable_prefix_caching=False)
    prompts = _ids(random_prompts(2, 256, 5, 15, seed=6))
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    a, b = LoRARequest("full", 1, str(full)), LoRARequest("qv", 2, str(qv))
    first = _tokens(llm.generate(prompts, sp, use_tqdm=False, lora_request=a))
    other = _tokens(llm.generate(prompts, sp, use_tqdm=False, lora_request=b))
    again = _tokens(llm.generate(prompts, sp, use_tqdm=False, lora_request=a))
    manager = llm.llm_engine.engine_core.executor.runner.lora
    assert list(manager.loaded) == [1]
    assert first == again and first != other
    # Both adapters in one call with max_loras=1: run one adapter at a time, same tokens.
    both = _tokens(llm.generate(prompts * 2, sp, use_tqdm=False, lora_request=[a, a, b, b]))
    assert both == first + other
    outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=[a, None])
    assert [o.lora_request for o in outs] == [a, None]


def test_parallel_samples_keep_the_adapter(tiny):
    model, full, _ = tiny
    llm = LLM(str(model), skip_tokenizer_init=True, enable_lora=True)
    lora = LoRARequest("full", 1, str(full))
    prompt = _ids(random_prompts(1, 256, 8, 8, seed=7))
    one = llm.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                              ignore_eos=True),
                       use_tqdm=False, lora_request=lora)[0]
    two = llm.generate(prompt, SamplingParams(n=2, max_tokens=MAX_TOKENS, temperature=0,
                                              ignore_eos=True),
                       use_tqdm=False, lora_request=lora)[0]
    assert [c.token_ids for c in two.outputs] == [one.outputs[0].token_ids] * 2


def test_bundled_gguf_with_an_adapter(tmp_path):
    """The bundled SmolLM2 on its Q4_1 blocks (the native quantized GEMM and the native
    layer stack for base steps): an adapter changes the tokens, and base and adapter
    requests give the same tokens alone and sharing steps."""
    llm = LLM(enable_lora=True, max_lora_rank=8, kv_cache_space=0.05)
    hf_config = llm.llm_engine.config.model.hf_config
    adapter = save_tiny_lora(tmp_path / "smol", hf_config, rank=8, std=0.05,
                             targets=("q_proj", "v_proj", "down_proj"))
    lora = LoRARequest("smol", 1, str(adapter))
    prompts = ["The capital of France is", "def fibonacci(n):"]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    mixed = _tokens(llm.generate(prompts * 2, sp, use_tqdm=False,
                                 lora_request=[None, None, lora, lora]))
    base = _tokens(llm.generate(prompts, sp, use_tqdm=False))
    adapted = _tokens(llm.generate(prompts, sp, use_tqdm=False, lora_request=lora))
    assert mixed == base + adapted
    assert adapted != base


def test_native_stack_equals_python_layers(tiny):
    """The native decoder stack runs a step's adapters itself (cpu_decoder.cpp); the
    Python layers' linears apply them through the same op: the same bits."""
    model, full, qv = tiny
    llm = LLM(str(model), skip_tokenizer_init=True, enable_lora=True, max_loras=2,
              enable_prefix_caching=False)
    inner = llm.llm_engine.engine_core.executor.runner.model.model
    prompts = _ids(random_prompts(4, 256, 5, 30, seed=8))
    loras = [LoRARequest("full", 1, str(full)), None, LoRARequest("qv", 2, str(qv)), None]
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=3)
    native = llm.generate(prompts, sp, use_tqdm=False, lora_request=loras)
    assert inner._native is not None  # the stack ran
    inner.use_native_layers = False
    python = llm.generate(prompts, sp, use_tqdm=False, lora_request=loras)
    for a, b in zip(native, python):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_speculative_decoding_keeps_the_adapter(tiny):
    """Prompt-lookup proposals are verified by the adapted model: the tokens of plain
    decoding with the adapter."""
    model, full, _ = tiny
    lora = LoRARequest("full", 1, str(full))
    # Repetitive prompts, so that prompt lookup proposes (and some proposals hold).
    prompts = _ids([[5, 6, 7, 8] * 6, [9, 10, 11] * 8])
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    plain = LLM(str(model), skip_tokenizer_init=True, enable_lora=True)
    spec = LLM(str(model), skip_tokenizer_init=True, enable_lora=True,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                   "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    want = _tokens(plain.generate(prompts, sp, use_tqdm=False, lora_request=lora))
    assert _tokens(spec.generate(prompts, sp, use_tqdm=False, lora_request=lora)) == want
    assert spec.llm_engine.engine_core.scheduler.num_draft_tokens > 0


def test_beam_search_with_an_adapter(tiny):
    """Beam search runs each beam's steps with the prompt's adapter: width 1 is the
    adapter's greedy run, and the adapter changes the beams."""
    from pagedllm import BeamSearchParams

    model, full, _ = tiny
    llm = LLM(str(model), skip_tokenizer_init=True, dtype="float32", enable_lora=True)
    lora = LoRARequest("full", 1, str(full))
    prompts = random_prompts(2, 256, 6, 12, seed=12)
    greedy = _tokens(llm.generate(_ids(prompts), SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False, lora_request=lora))
    one = llm.beam_search(_ids(prompts), BeamSearchParams(beam_width=1, max_tokens=6,
                                                          ignore_eos=True),
                          lora_request=lora)
    assert [o.sequences[0].tokens[len(p):] for o, p in zip(one, prompts)] == greedy
    wide = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    adapted = llm.beam_search(_ids(prompts), wide, lora_request=[lora, lora])
    base = llm.beam_search(_ids(prompts), wide)
    assert [s.tokens for o in adapted for s in o.sequences] != \
        [s.tokens for o in base for s in o.sequences]


def test_an_adapter_that_fails_to_load_fails_only_its_requests(tiny, tmp_path):
    """An adapter checked when its request arrived but unreadable when the worker loads
    it (its file replaced meanwhile): its requests finish as aborted, saying why; the
    others in the same steps get their usual tokens; the engine keeps running; the KV
    the failed requests computed (as the base model) is not served later as theirs."""
    import shutil

    model, full, _ = tiny
    broken = tmp_path / "broken"
    shutil.copytree(full, broken)
    weights = (broken / "adapter_model.safetensors").read_bytes()
    llm = LLM(str(model), skip_tokenizer_init=True, dtype="float32", enable_lora=True,
              max_loras=2)
    prompts = random_prompts(3, 256, 40, 40, seed=9)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    ok, bad = LoRARequest("full", 1, str(full)), LoRARequest("broken", 3, str(broken))
    want = _tokens(llm.generate(_ids(prompts), sp, use_tqdm=False,
                                lora_request=[None, ok, ok]))
    engine = llm.llm_engine
    engine.add_request("bad", _ids(prompts)[2], sp, lora_request=bad)  # checked here
    (broken / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    engine.add_request("base", _ids(prompts)[0], sp)
    engine.add_request("ok", _ids(prompts)[1], sp, lora_request=ok)
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    assert done["bad"].outputs[0].finish_reason == "abort"
    assert done["bad"].outputs[0].token_ids == []
    assert _tokens([done["base"], done["ok"]]) == want[:2]
    # Files back: the adapter loads now and computes its own KV (a copy of `full`: the
    # same tokens), not the base model's blocks of the failed attempt from the cache.
    (broken / "adapter_model.safetensors").write_bytes(weights)
    again = llm.generate(_ids(prompts)[2:], sp, use_tqdm=False, lora_request=bad)[0]
    assert again.num_cached_tokens == 0 and _tokens([again]) == want[2:]


def test_prompt_embeds_with_an_adapter(tiny):
    """A prompt given as its own token embeddings runs under its adapter as its tokens
    do (the LoRA step passes the embeddings in)."""
    from safetensors.torch import load_file

    model, full, _ = tiny
    table = load_file(str(model / "model.safetensors"))["model.embed_tokens.weight"]
    llm = LLM(str(model), dtype="float32", skip_tokenizer_init=True, enable_lora=True,
              enable_prompt_embeds=True)
    prompts = random_prompts(3, 256, 10, 30, seed=9)
    lora = LoRARequest("full", 1, str(full))
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    by_ids = llm.generate(_ids(prompts), sp, use_tqdm=False, lora_request=lora)
    by_rows = llm.generate([{"prompt_embeds": table[torch.tensor(p)]} for p in prompts], sp,
                           use_tqdm=False, lora_request=lora)
    assert _tokens(by_rows) == _tokens(by_ids)
    base = llm.generate(_ids(prompts), sp, use_tqdm=False)
    assert _tokens(base) != _tokens(by_ids)  # the adapter changes them


def _subset(full, path, leaves):
    """`full` with only the weights of the linears named `leaves`."""
    import json

    from safetensors.torch import load_file, save_file

    path.mkdir()
    weights = load_file(str(full / "adapter_model.safetensors"))
    save_file({k: v for k, v in weights.items() if k.split(".")[-3] in leaves},
              path / "adapter_model.safetensors")
    config = json.loads((full / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps(config | {"target_modules":
                                                                   list(leaves)}))
    return path


def test_lora_target_modules_leave_the_other_linears_alone(tiny, tmp_path):
    """With lora_target_modules an adapter acts as if it had only those linears' weights
    (a fused name stands for its parts); an unknown name is refused."""
    from pagedllm.errors import ConfigError

    model, full, _ = tiny
    prompts = _ids(random_prompts(2, 256, 5, 12, seed=8))
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                        logprobs=2)
    for targets, leaves in ((["o_proj", "down_proj"], ("o_proj", "down_proj")),
                            (["qkv_proj"], ("q_proj", "k_proj", "v_proj"))):
        subset = _subset(full, tmp_path / "-".join(targets), leaves)
        limited = LLM(str(model), skip_tokenizer_init=True, dtype="float32",
                      enable_lora=True, lora_target_modules=targets)
        plain = LLM(str(model), skip_tokenizer_init=True, dtype="float32", enable_lora=True)
        got = limited.generate(prompts, sp, lora_request=LoRARequest("full", 1, str(full)),
                               use_tqdm=False)
        want = plain.generate(prompts, sp, lora_request=LoRARequest("sub", 1, str(subset)),
                              use_tqdm=False)
        whole = plain.generate(prompts, sp, lora_request=LoRARequest("full", 2, str(full)),
                               use_tqdm=False)
        assert _tokens(got) == _tokens(want) != _tokens(whole)
        assert [o.outputs[0].cumulative_logprob for o in got] == \
            [o.outputs[0].cumulative_logprob for o in want]
    with pytest.raises(ConfigError, match="lora_target_modules: lm_head"):
        LLM(str(model), skip_tokenizer_init=True, enable_lora=True,
            lora_target_modules=["lm_head"])


def test_lora_dtype_rounds_the_adapter(tiny, tmp_path):
    """vLLM's --lora-dtype bfloat16: the adapter's weights rounded to bfloat16 on load,
    the very outputs of the same adapter stored rounded; auto keeps the file's values."""
    import shutil

    from safetensors.torch import load_file, save_file

    model, full, _ = tiny
    rounded = tmp_path / "rounded"
    shutil.copytree(full, rounded)
    file = rounded / "adapter_model.safetensors"
    save_file({k: v.bfloat16().float() for k, v in load_file(file).items()}, str(file))
    prompts = random_prompts(2, 256, 5, 20, seed=3)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=3)

    def run(adapter, **kw):
        llm = LLM(str(model), skip_tokenizer_init=True, dtype="float32", enable_lora=True,
                  **kw)
        outs = llm.generate(_ids(prompts), sp, use_tqdm=False,
                            lora_request=LoRARequest("a", 1, str(adapter)))
        llm.shutdown()
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    as_bf16 = run(full, lora_dtype="bfloat16")
    assert as_bf16 == run(rounded)
    assert as_bf16 != run(full)  # not vacuous: the rounding moves the logprobs
    with pytest.raises(ValueError, match="lora_dtype must be one of"):
        LLM(str(model), enable_lora=True, lora_dtype="float8")
