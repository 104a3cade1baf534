"""--enable-mfu-metrics (core/perf.py): each step's estimated FLOPs and bytes per
worker, counted by the engine core and exported as vLLM's counters."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedllm import LLM, SamplingParams
from pagedllm.core.perf import ModelShape, PerfCounter
from pagedllm.engine.core_proc import SchedulerStats
from pagedllm.metrics import EngineMetrics
from tests.utils import save_tiny_model, tiny_llama_config

SHAPE = ModelShape(num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
                   intermediate_size=16, vocab_size=10, weight_bytes_per_param=2.0,
                   kv_bytes_per_elem=2.0)


def test_the_estimates_of_one_step_by_hand():
    # Per layer: q 8x8 + k 8x4 + v 8x4 + o 8x8 = 192 attention weights, 3 x 8 x 16 =
    # 384 MLP weights; LM head 80. K/V: 2 layers x 2 x 4 dims x 2 bytes = 32 B a token.
    perf = PerfCounter(SHAPE)
    # A prefill of 3 tokens (attending to 1 + 2 + 3 positions, one row sampled) and a
    # decode at context 5 (attending to 6).
    perf.observe([(0, 3, 1), (5, 1, 1)])
    attn = 4 * 2 * 2 * 4 * (6 + 6)
    assert perf.flops == 2 * 4 * 2 * 576 + 2 * 2 * 80 + attn
    assert perf.read_bytes == (2 * 576 + 80) * 2 + 32 * (3 + 6)
    assert perf.write_bytes == 32 * 4
    # Two workers each do half; MoE layers count their active experts' math and read
    # every expert.
    half = PerfCounter(ModelShape(**{**SHAPE.__dict__, "num_workers": 2}))
    half.observe([(0, 3, 1), (5, 1, 1)])
    assert half.flops == perf.flops / 2 and half.read_bytes == perf.read_bytes / 2
    moe = ModelShape(**{**SHAPE.__dict__, "num_experts": 4, "experts_per_token": 2})
    assert moe.active_params_per_layer == 192 + 2 * 384
    assert moe.weight_params == 2 * (192 + 4 * 384) + 80


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_mfu"),
                           tiny_llama_config(vocab_size=64), seed=1)


def test_the_engine_counts_each_steps_work(path):
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, enable_mfu_metrics=True,
              max_num_batched_tokens=8, long_prefill_token_threshold=0)
    core = llm.llm_engine.engine_core
    shape = core.perf.shape
    assert shape.weight_bytes_per_param == 4.0 and shape.num_layers == 2
    steps = []
    work = core._step_work
    core._step_work = lambda so: steps.append(work(so)) or steps[-1]
    # 12 prompt tokens in chunks (the last samples), then 4 decodes.
    llm.generate([{"prompt_token_ids": list(range(1, 13))}],
                 SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                 use_tqdm=False)
    chunks = [s[0] for s in steps if s][:-4]
    decodes = [s[0] for s in steps if s][-4:]
    assert len(chunks) >= 2 and sum(n for _, n, _ in chunks) == 12
    assert [c for c, _, _ in chunks] == [sum(n for _, n, _ in chunks[:i])
                                         for i in range(len(chunks))]
    assert [r for _, _, r in chunks] == [0] * (len(chunks) - 1) + [1]
    assert decodes == [(12, 1, 1), (13, 1, 1), (14, 1, 1), (15, 1, 1)]
    expected = PerfCounter(shape)
    for step in chunks + decodes:
        expected.observe([step])
    assert (core.perf.flops, core.perf.read_bytes, core.perf.write_bytes) == (
        pytest.approx(expected.flops), pytest.approx(expected.read_bytes),
        pytest.approx(expected.write_bytes))
    assert LLM(str(path), dtype="float32", skip_tokenizer_init=True
               ).llm_engine.engine_core.perf is None  # off by default


def _stats(flops: float, read: float, written: float) -> SchedulerStats:
    return SchedulerStats(num_running=1, num_waiting=0, kv_cache_usage=0.1,
                          prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
                          num_free_blocks=5, num_blocks=9, estimated_flops=flops,
                          estimated_read_bytes=read, estimated_write_bytes=written)


def test_the_counters_and_the_log_line():
    metrics = EngineMetrics("m", mfu_metrics=True)
    metrics.observe_scheduler_stats(_stats(1e12, 2e9, 1e9))
    metrics.observe_scheduler_stats(_stats(3e12, 5e9, 2e9))
    samples = {s.name: s.value for fam in text_string_to_metric_families(
        metrics.render().decode()) for s in fam.samples}
    assert samples["pagedllm:estimated_flops_per_gpu_total"] == 3e12
    assert samples["pagedllm:estimated_read_bytes_per_gpu_total"] == 5e9
    assert samples["pagedllm:estimated_write_bytes_per_gpu_total"] == 2e9
    assert "TFLOP/s" in metrics.stats_log.log()
    plain = EngineMetrics("m")
    plain.observe_scheduler_stats(_stats(1e12, 2e9, 1e9))
    assert b"estimated_flops" not in plain.render()


def test_iteration_details_log_each_steps_requests_and_tokens(path, caplog):
    """--enable-logging-iteration-details (vLLM's): one line per step."""
    import logging
    import re

    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True,
              enable_logging_iteration_details=True, max_num_batched_tokens=8,
              long_prefill_token_threshold=0)
    with caplog.at_level(logging.INFO, logger="pagedllm.engine.engine_core"):
        llm.generate([{"prompt_token_ids": list(range(1, 13))},
                      {"prompt_token_ids": [5, 6]}],
                     SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                     use_tqdm=False)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Iteration")]
    parsed = [tuple(map(int, re.match(r"Iteration (\d+): (\d+) prefill requests \((\d+) "
                                      r"tokens\), (\d+) decode requests \((\d+) tokens\), "
                                      r"[\d.]+ ms$", line).groups())) for line in lines]
    assert [p[0] for p in parsed] == list(range(1, len(parsed) + 1))
    # Every prompt token is a prefill token once; each request decodes twice.
    assert sum(p[2] for p in parsed) == 14 and sum(p[4] for p in parsed) == 4
    assert all(p[2] + p[4] <= 8 for p in parsed)  # the step budget
    assert not [r for r in caplog.records if r.getMessage().startswith("Iteration")
                and r.name != "pagedllm.engine.engine_core"]
