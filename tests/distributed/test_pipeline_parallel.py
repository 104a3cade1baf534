"""Pipeline parallelism through `LLM`: pp=2 (and tp=2 x pp=2) worker processes against one
worker, token for token in float32, for every model family.

The runs use max_num_seqs=4 (2 requests per step over 2 stages) with more prompts than
that, so the engine really keeps two steps in flight (checked), and one run forces
chunked prefill, prefix-cache hits, seeded sampling with penalties and logprobs, whose
state the last stage must rebuild from the tokens the scheduler sends it (it never sees
its own samples directly).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.parallel_state import ParallelState, SINGLE_RANK
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.errors import EngineDeadError
from pagedllm.models.gpt2 import GPT2LMHeadModel
from pagedllm.models.pipeline import layer_range
from pagedllm.models.registry import (get_model_class, is_encoder_only,
                                      supported_architectures)
from pagedllm.worker.model_loader import load_model
from tests.distributed.helpers import (assert_logprobs_close, generate, token_ids,
                                       worker_processes)
from tests.distributed.test_tp_models import ODD_VOCAB, OTHER_FAMILIES
from tests.utils import random_prompts, save_tiny_model, tiny_llama_config

VOCAB = 256


def _gemma2_config():
    from transformers import Gemma2Config

    return Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, query_pre_attn_scalar=16, sliding_window=6,
                        max_position_embeddings=256, attn_logit_softcapping=3.0,
                        final_logit_softcapping=3.0, bos_token_id=None,
                        eos_token_id=None, pad_token_id=None)


def _qwen2_tied_config():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=256, tie_word_embeddings=True,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _three_layers(make):
    """One of test_tp_models' tiny configs with 3 layers (an uneven split)."""
    def make_three():
        cfg = make()
        cfg.num_hidden_layers = 3
        return cfg
    return make_three


MODELS = {
    # 3 layers over 2 stages: an uneven split (2 + 1).
    "llama": lambda: tiny_llama_config(num_hidden_layers=3),
    # The tied head on the last stage loads the embedding's weight.
    "qwen2_tied": _qwen2_tied_config,
    # Sliding window and soft-caps; the embedding scale on the first stage only.
    "gemma2": _gemma2_config,
    # GPT-2 (learned positions, tied head), Bloom (ALiBi, embedding LayerNorm, tied head),
    # OPT (project_in on the first stage, project_out on the last), GPT-NeoX (untied
    # embed_out), each with an odd vocabulary (251).
    **{name: _three_layers(make) for name, make in OTHER_FAMILIES.items()},
}


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory):
    return {name: save_tiny_model(tmp_path_factory.mktemp(name), make())
            for name, make in MODELS.items()}


@pytest.fixture(scope="module")
def prompts():
    # Ids within every model's vocabulary (the odd ones have 251).
    return random_prompts(5, ODD_VOCAB["vocab_size"], 3, 30, seed=5)


def _make_llm(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", skip_tokenizer_init=True, max_num_seqs=4, **kw)




def _count_in_flight(llm) -> list[int]:
    """Record the number of steps in flight after each send (a list that fills up)."""
    core = llm.llm_engine.engine_core
    executor, seen = core.executor, []
    send = executor.execute_model

    def counting(scheduler_output, non_block=False):
        future = send(scheduler_output, non_block)
        seen.append(len(core.batch_queue) + 1)
        return future

    executor.execute_model = counting
    return seen


def test_layer_range_splits_evenly_first_stages_take_the_rest():
    ranges = [layer_range(7, ParallelState(pp_rank=r, pp_size=3, prev_group=object(),
                                           next_group=object())) for r in range(3)]
    assert ranges == [(0, 3), (3, 5), (5, 7)]
    assert layer_range(5, SINGLE_RANK) == (0, 5)


@pytest.mark.parametrize("name, tp", [("llama", 1), ("qwen2_tied", 1), ("gemma2", 1),
                                      ("gpt2_odd_vocab", 1), ("opt_projected", 1),
                                      ("gpt_neox", 1), ("bloom", 1), ("llama", 2),
                                      # ALiBi slopes split with the heads on both stages.
                                      ("bloom", 2)])
def test_greedy_parity(model_paths, prompts, name, tp):
    path = model_paths[name]
    ref_llm = _make_llm(path)
    ref = token_ids(generate(ref_llm, prompts))
    ref_llm.shutdown()
    llm = _make_llm(path, pipeline_parallel_size=2, tensor_parallel_size=tp)
    try:
        assert len(worker_processes()) == 2 * tp
        in_flight = _count_in_flight(llm)
        assert token_ids(generate(llm, prompts)) == ref
        assert max(in_flight) == 2  # the stages overlapped
    finally:
        llm.shutdown()
    assert worker_processes() == []


def test_chunked_prefill_prefix_hits_sampling_state(model_paths, prompts):
    # 7 tokens per step: prompts are prefilled in chunks; 4-token blocks: the shared
    # 16-token prefix is 4 full blocks that later requests take from the prefix cache.
    shared = random_prompts(1, VOCAB, 16, 16, seed=11)[0]
    suffixed = [shared + p[:5] for p in prompts[:4]]
    kw = dict(block_size=4, max_num_batched_tokens=7)
    params = [SamplingParams(temperature=0, max_tokens=10, logprobs=2),
              # Seeded sampling with penalties: the sampler's state (generator, output
              # counts) must follow the tokens exactly.
              SamplingParams(temperature=0.8, seed=7, max_tokens=10, presence_penalty=0.5,
                             repetition_penalty=1.3, logprobs=1)]
    results = []
    for pp in (1, 2):
        llm = _make_llm(model_paths["llama"], pipeline_parallel_size=pp, **kw)
        try:
            results.append([generate(llm, [shared + [1]], p) + generate(llm, suffixed, p)
                            for p in params])
        finally:
            llm.shutdown()
    for ref, outs in zip(*results):
        assert token_ids(outs) == token_ids(ref)
        # The shared prefix hits (and, in the second round, whole earlier prompts).
        cached = [o.num_cached_tokens for o in outs[1:]]
        assert cached == [o.num_cached_tokens for o in ref[1:]] and min(cached) >= 16
        for ours, theirs in zip(outs, ref):
            assert_logprobs_close(ours.outputs[0].logprobs, theirs.outputs[0].logprobs)


def test_killed_stage_failsgenerate(model_paths, prompts):
    llm = _make_llm(model_paths["llama"], pipeline_parallel_size=2)
    try:
        generate(llm, prompts[:2])
        workers = worker_processes()
        assert len(workers) == 2
        # The first stage dies: the last one waits on hidden states that never come.
        os.kill(workers[0].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="worker"):
            generate(llm, prompts)
        assert time.monotonic() - start < 30
    finally:
        llm.shutdown()
    assert worker_processes() == []


def test_every_registered_family_supports_pp():
    # Encoder-only (embedding) families run on one worker so far: load_model rejects
    # them under PP by the same missing `supports_pp`.
    unsupported = [arch for arch in supported_architectures()
                   if not is_encoder_only(arch)
                   and not getattr(get_model_class(arch), "supports_pp", False)]
    assert unsupported == []


def test_family_without_pp_is_rejected(monkeypatch, model_paths):
    # No registered family lacks it today: a future one is stood in for by GPT-2.
    monkeypatch.setattr(GPT2LMHeadModel, "supports_pp", False)
    args = EngineArgs(model=str(model_paths["gpt2_odd_vocab"]), dtype="float32")
    first_stage = ParallelState(pp_rank=0, pp_size=2, next_group=object())
    with pytest.raises(ValueError, match="pipeline parallelism is not supported for "
                                         "GPT2LMHeadModel"):
        load_model(args.create_engine_config().model, "cpu", torch.device("cpu"),
                   torch.float32, first_stage)


def test_more_stages_than_layers_is_rejected(model_paths):
    with pytest.raises(ValueError, match="more than the model's 3 layers"):
        _make_llm(model_paths["llama"], pipeline_parallel_size=4)
    assert worker_processes() == []
