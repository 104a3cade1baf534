"""Expert parallelism (vLLM's --enable-expert-parallel): under tensor parallelism each
rank holds whole experts, its share of them, and the MoE block's all-reduce adds the
ranks' partial sums.

The experts' placement is vLLM's (linear or round_robin, uneven counts included); a
sharded model's logits match the whole model's; `LLM` with worker processes gives the
one-worker greedy tokens, for Mixtral and for a Qwen3-MoE whose expert width does not
split between the ranks (refused without expert parallelism).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers as tf

from pagedllm import LLM
from pagedllm.distributed.parallel_state import SINGLE_RANK, ParallelState
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.cli import build_parser, engine_args_from
from pagedllm.errors import ConfigError
from pagedllm.models.mixtral import ExpertLinear
from pagedllm.worker.model_loader import load_model
from tests.distributed.helpers import generate, token_ids, worker_processes
from tests.distributed.ranks import run_ranks
from tests.distributed.test_tp_models import _LOAD_LOCK, _sequence_logits
from tests.models.test_decoder_parity import COMMON, SHARP, SMALL
from tests.utils import random_prompts, save_tiny_model, scale_saved_weights

# 5 experts: 2 ranks hold 3 and 2 of them. Qwen3-MoE's experts are 45 wide, which two
# ranks cannot slice; its layer 1 is a dense MLP (128 wide, sliced as usual).
MODELS = {
    "mixtral": (lambda: tf.MixtralConfig(**COMMON, **{**SMALL, "intermediate_size": 96},
                                         num_local_experts=5, num_experts_per_tok=2),
                {**SHARP, "block_sparse_moe.gate": 10.0}),
    "qwen3_moe": (lambda: tf.Qwen3MoeConfig(**COMMON, **SMALL, head_dim=16, num_experts=5,
                                            num_experts_per_tok=3, moe_intermediate_size=45,
                                            norm_topk_prob=True, mlp_only_layers=[1]),
                  {**SHARP, "mlp.gate.": 10.0}),
}


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory):
    paths = {}
    for name, (make, scales) in MODELS.items():
        paths[name] = save_tiny_model(tmp_path_factory.mktemp(name), make())
        scale_saved_weights(paths[name], scales)
    return paths


def _ranks(placement: str, size: int = 3) -> list[ParallelState]:
    return [ParallelState(tp_rank=r, tp_size=size, group=object(), expert_parallel=True,
                          expert_placement=placement) for r in range(size)]


def test_placement_is_vllms():
    # vLLM's determine_expert_map: linear gives the first E % N ranks one more expert.
    assert [ps.local_experts(8) for ps in _ranks("linear")] == [[0, 1, 2], [3, 4, 5],
                                                                 [6, 7]]
    assert [ps.local_experts(8) for ps in _ranks("round_robin")] == [[0, 3, 6], [1, 4, 7],
                                                                      [2, 5]]
    assert [ps.local_experts(2) for ps in _ranks("linear")] == [[0], [1], []]
    # Without expert parallelism every rank holds (a slice of) every expert.
    sliced = dataclasses.replace(_ranks("linear")[1], expert_parallel=False)
    assert sliced.ep_size == 1 and sliced.local_experts(8) == list(range(8))
    assert SINGLE_RANK.local_experts(4) == [0, 1, 2, 3]


def _experts_and_logits(path, parallel: ParallelState, token_ids):
    """(each MoE linear's (expert ids, weight shape), logits of every position)."""
    model_config = EngineArgs(model=str(path), dtype="float32").create_engine_config().model
    with _LOAD_LOCK:
        model = load_model(model_config, "cpu", torch.device("cpu"), torch.float32,
                           parallel)
    held = [(m.expert_ids, tuple(m.weight.shape)) for m in model.modules()
            if isinstance(m, ExpertLinear)]
    return held, _sequence_logits(model_config, parallel, token_ids, chunk=13)


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
@pytest.mark.parametrize("name", list(MODELS))
def test_ranks_hold_whole_experts_and_match_the_whole_model(model_paths, name, placement):
    cfg = MODELS[name][0]()
    inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    ids = random_prompts(1, COMMON["vocab_size"], 21, 21, seed=5)[0]
    _, whole = _experts_and_logits(model_paths[name], SINGLE_RANK, ids)
    shards = run_ranks(2, lambda ps: _experts_and_logits(
        model_paths[name], dataclasses.replace(ps, expert_parallel=True,
                                               expert_placement=placement), ids))
    expected = {"linear": [[0, 1, 2], [3, 4]], "round_robin": [[0, 2, 4], [1, 3]]}[placement]
    moe_layers = {"mixtral": 2, "qwen3_moe": 1}[name]  # Qwen3-MoE's layer 1 is dense
    for rank, (held, logits) in enumerate(shards):
        mine = expected[rank]
        # Whole experts: w13 holds gate and up rows of the full width, w2 all its columns.
        assert held == [(mine, (len(mine), 2 * inter, cfg.hidden_size)),
                        (mine, (len(mine), cfg.hidden_size, inter))] * moe_layers
        assert (logits is None) == (rank == 1)
    torch.testing.assert_close(shards[0][1], whole, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(MODELS))
def test_llm_with_expert_parallel_workers_matches_one_worker(model_paths, name):
    prompts = random_prompts(5, COMMON["vocab_size"], 3, 30, seed=3)
    path = str(model_paths[name])
    one = LLM(path, dtype="float32", skip_tokenizer_init=True)
    try:
        expected = token_ids(generate(one, prompts))
    finally:
        one.shutdown()
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, tensor_parallel_size=2,
              enable_expert_parallel=True, expert_placement_strategy="round_robin")
    try:
        assert len(worker_processes()) == 2
        assert token_ids(generate(llm, prompts)) == expected
    finally:
        llm.shutdown()


def test_the_options_and_their_refusals(model_paths):
    # The experts' width must split between the ranks unless they hold whole experts.
    with pytest.raises(ConfigError, match=r"moe_intermediate_size=45 must be divisible"):
        EngineArgs(model=str(model_paths["qwen3_moe"]),
                   tensor_parallel_size=2).create_engine_config()
    with pytest.raises(ConfigError, match="expert_placement_strategy must be one of"):
        EngineArgs(model=str(model_paths["mixtral"]), enable_expert_parallel=True,
                   expert_placement_strategy="random").create_engine_config()
    with pytest.raises(ConfigError, match="data parallel replicas"):
        EngineArgs(model=str(model_paths["mixtral"]), enable_expert_parallel=True,
                   data_parallel_size=2).create_engine_config()
    parallel = EngineArgs(model=str(model_paths["qwen3_moe"]), tensor_parallel_size=2,
                          enable_expert_parallel=True).create_engine_config().parallel
    assert parallel.enable_expert_parallel and parallel.expert_placement_strategy == "linear"
    ns = build_parser().parse_args(["serve", "m", "-tp", "2", "-ep",
                                    "--expert-placement-strategy", "round_robin"])
    args = engine_args_from(ns)
    assert args.enable_expert_parallel and args.expert_placement_strategy == "round_robin"
