"""collective_rpc and worker_extension_cls (vLLM's; worker/rpc.py): a call run on every
rank's worker, offline, through the engine-core process, and on tensor-parallel ranks."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pagedllm import LLM, EngineArgs, SamplingParams
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.errors import ConfigError
from tests.utils import save_tiny_model, tiny_llama_config

EXT = "tests.engine.test_collective_rpc:WeightProbe"
PROMPT = {"prompt_token_ids": [5, 17, 33, 2, 9, 41, 7]}


class WeightProbe:
    """An extension as RL frameworks write them: it reads and changes the rank's model."""

    def param_sum(self) -> float:
        return float(sum(p.double().sum() for p in self.model.parameters()))

    def zero_weight(self, name: str) -> list[int]:
        # The CPU kernels run on packed copies of the parameters: new values go in
        # through the runner's update_weights (as a trainer's weight sync would).
        shape = list(dict(self.model.named_parameters())[name].shape)
        self.model_runner.update_weights([(name, torch.zeros(shape))])
        return shape

    def remember(self, value: int) -> None:
        self.remembered = value

    def recall(self) -> int:
        return self.remembered


class Clashing:
    def model(self) -> None:  # the worker has `model` already
        pass


def rank_and_device(worker, offset: int = 0) -> tuple[int, str]:
    return worker.rank + offset, str(worker.device)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_rpc"),
                           tiny_llama_config(vocab_size=64), seed=2)


def _greedy(llm: LLM) -> list[int]:
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8),
                       use_tqdm=False)
    return out[0].outputs[0].token_ids


def test_methods_and_functions_run_on_the_worker_and_keep_its_state(path):
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True,
              worker_extension_cls=EXT)
    runner_model = llm.llm_engine.engine_core.executor.runner.model
    expected = float(sum(p.double().sum() for p in runner_model.parameters()))
    assert llm.collective_rpc("param_sum") == [pytest.approx(expected)]
    assert llm.collective_rpc(rank_and_device, args=(10,)) == [(10, "cpu")]
    assert llm.collective_rpc(rank_and_device, kwargs={"offset": 3}) == [(3, "cpu")]
    llm.collective_rpc("remember", args=(42,))
    assert llm.collective_rpc("recall") == [42]
    # What a method changes is what the engine runs: a zeroed LM head makes every
    # logit equal (greedy then takes token 0); the weights restored, the old tokens.
    before = _greedy(llm)
    assert llm.collective_rpc("zero_weight", args=("lm_head.weight",)) == [[64, 64]]
    llm.reset_prefix_cache()  # its K/V came from the old weights (none changed here)
    assert _greedy(llm) == [0] * 8 != before
    llm.update_weights(_lm_head(path))
    assert _greedy(llm) == before


def _lm_head(path) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    weights = load_file(str(path / "model.safetensors"))
    return [("lm_head.weight", weights["lm_head.weight"])]


def test_bad_calls_and_extensions_are_refused_by_name(path):
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True)
    with pytest.raises(AttributeError, match="no method 'param_sum'"):
        llm.collective_rpc("param_sum")  # no extension
    with pytest.raises(ValueError, match="importable by name"):
        llm.collective_rpc(lambda worker: worker.rank)
    with pytest.raises(ValueError, match="timeout"):
        llm.collective_rpc(rank_and_device, timeout=5.0)
    assert llm.collective_rpc(rank_and_device) == [(0, "cpu")]
    with pytest.raises(ConfigError, match="cannot import"):
        EngineArgs(model=str(path), worker_extension_cls="no_such_module:X",
                   ).create_engine_config()
    with pytest.raises(ConfigError, match="redefines 'model'"):
        EngineArgs(model=str(path), worker_extension_cls=(
            "tests.engine.test_collective_rpc:Clashing")).create_engine_config()


def test_every_tensor_parallel_rank_answers_with_its_shard(path):
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
              tensor_parallel_size=2, worker_extension_cls=EXT)
    try:
        assert llm.collective_rpc(rank_and_device) == [(0, "cpu"), (1, "cpu")]
        sums = llm.collective_rpc("param_sum")
        assert len(sums) == 2 and sums[0] != sums[1]  # each rank its own shard
        llm.collective_rpc("remember", args=(7,))
        assert llm.collective_rpc("recall") == [7, 7]
    finally:
        llm.shutdown()


def test_through_the_engine_core_process(path):
    async def main() -> None:
        config = EngineArgs(model=str(path), dtype="float32",
                            worker_extension_cls=EXT).create_engine_config()
        llm = AsyncLLM(config, log_stats_interval_s=0, skip_tokenizer_init=True)
        try:
            await llm.start()
            assert await llm.collective_rpc(rank_and_device, args=(1,)) == [(1, "cpu")]
            await llm.collective_rpc("remember", args=(5,))
            assert await llm.collective_rpc("recall") == [5]
            with pytest.raises(AttributeError, match="no method 'forget'"):
                await llm.collective_rpc("forget")
            # A failed call leaves the engine serving.
            params = SamplingParams(temperature=0, max_tokens=4)
            outs = [o async for o in llm.generate(PROMPT, params, "r0")]
            assert len(outs[-1].outputs[0].token_ids) == 4
        finally:
            llm.shutdown()

    asyncio.run(main())
