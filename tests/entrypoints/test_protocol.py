"""Request models -> SamplingParams, and the metrics registry, without a server."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.engine.core_proc import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.entrypoints.openai.serving_common import OpenAIServing
from pagedllm.errors import InvalidRequestError
from pagedllm.metrics import EngineMetrics
from pagedllm.request import Request
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


def test_completion_fields_map_to_sampling_params():
    req = CompletionRequest(prompt="x", max_tokens=7, n=2, best_of=3, temperature=0.5,
                            top_k=5, min_p=0.1, repetition_penalty=1.2, stop=["a"],
                            stop_token_ids=[3], ignore_eos=True, min_tokens=2, seed=4,
                            logprobs=2, logit_bias={"5": -1.0})
    sp = OpenAIServing.sampling_params(req.sampling_kwargs(), stream=False)
    assert (sp.max_tokens, sp.n, sp.best_of, sp.temperature, sp.top_k) == (7, 2, 3, 0.5, 5)
    assert (sp.min_p, sp.repetition_penalty, sp.stop, sp.stop_token_ids) == (
        0.1, 1.2, ["a"], [3])
    assert sp.ignore_eos and sp.min_tokens == 2 and sp.seed == 4 and sp.logprobs == 2
    assert sp.logit_bias == {5: -1.0}
    assert sp.output_kind == RequestOutputKind.FINAL_ONLY
    streaming = OpenAIServing.sampling_params(req.sampling_kwargs(), stream=True)
    assert streaming.output_kind == RequestOutputKind.CUMULATIVE


def test_unset_fields_keep_engine_defaults():
    sp = OpenAIServing.sampling_params(CompletionRequest(prompt="x").sampling_kwargs(), False)
    default = SamplingParams()
    assert (sp.temperature, sp.top_p, sp.top_k, sp.n) == (
        default.temperature, default.top_p, default.top_k, 1)


def test_chat_response_format_and_logprobs():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=3,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    sp = OpenAIServing.sampling_params(req.sampling_kwargs(10), stream=False)
    assert sp.structured_outputs.json == schema and sp.logprobs == 3
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                response_format={"type": "json_object"})
    sp = OpenAIServing.sampling_params(req.sampling_kwargs(10), stream=False)
    assert sp.structured_outputs.json_object
    multi = ChatCompletionRequest(messages=[{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert multi.messages[0].text() == "ab"


def test_unknown_sampling_field_refused_unless_neutral():
    kw = {"temperature": 0.5, "not_a_field": 0}
    assert OpenAIServing.sampling_params(kw, False).temperature == 0.5
    with pytest.raises(InvalidRequestError, match="not_a_field"):
        OpenAIServing.sampling_params({"not_a_field": 3}, False)


def test_metrics_from_output_batches():
    metrics = EngineMetrics("m")
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=2), eos_token_id=None,
                  arrival_time=100.0)
    stats = SchedulerStats(num_running=1, num_waiting=2, kv_cache_usage=0.25,
                           prefix_cache_queries=3, prefix_cache_hits=0, num_preemptions=0,
                           num_free_blocks=5, num_blocks=9)
    first = EngineCoreOutputs(outputs=[EngineCoreOutput("r", [7], "running",
                                                        first_scheduled_time=100.5)],
                              scheduler_stats=stats, timestamp=101.0)
    metrics.observe_scheduler_stats(stats)
    metrics.observe_outputs(first, {"r": req})
    req.append_output_token_ids([7])
    last = EngineCoreOutputs(outputs=[EngineCoreOutput("r", [8], "finished_length")],
                             scheduler_stats=stats, timestamp=101.5)
    metrics.observe_outputs(last, {"r": req})
    samples = {s.name: s.value for fam in text_string_to_metric_families(
        metrics.render().decode()) for s in fam.samples if "bucket" not in s.name}
    assert samples["pagedllm:prompt_tokens_total"] == 3
    assert samples["pagedllm:generation_tokens_total"] == 2
    assert samples["pagedllm:request_success_total"] == 1
    assert samples["pagedllm:time_to_first_token_seconds_sum"] == pytest.approx(1.0)
    assert samples["pagedllm:request_queue_time_seconds_sum"] == pytest.approx(0.5)
    assert samples["pagedllm:e2e_request_latency_seconds_sum"] == pytest.approx(1.5)
    assert samples["pagedllm:time_per_output_token_seconds_sum"] == pytest.approx(0.5)
    assert samples["pagedllm:num_requests_waiting"] == 2
    assert samples["pagedllm:kv_cache_usage_perc"] == 0.25
    line = metrics.stats_log.log()
    assert "Avg generation throughput" in line and "Running: 1 reqs, Waiting: 2 reqs" in line
    assert "KV cache usage: 25.0%" in line
    # Each instance has its own registry: a fresh one has recorded nothing.
    fresh = [s for fam in text_string_to_metric_families(EngineMetrics("m").render().decode())
             for s in fam.samples]
    assert not [s for s in fresh if s.name == "pagedllm:prompt_tokens_total"]


def test_spec_decode_counters_take_increments():
    metrics = EngineMetrics("m")

    def stats(drafts: int, accepted: int) -> SchedulerStats:
        return SchedulerStats(num_running=1, num_waiting=0, kv_cache_usage=0.1,
                              prefix_cache_queries=0, prefix_cache_hits=0,
                              num_preemptions=0, num_free_blocks=5, num_blocks=9,
                              num_draft_tokens=drafts, num_accepted_tokens=accepted)

    metrics.observe_scheduler_stats(stats(8, 3))
    metrics.observe_scheduler_stats(stats(20, 11))
    samples = {s.name: s.value for fam in text_string_to_metric_families(
        metrics.render().decode()) for s in fam.samples}
    assert samples["pagedllm:spec_decode_num_draft_tokens_total"] == 20
    assert samples["pagedllm:spec_decode_num_accepted_tokens_total"] == 11


@pytest.mark.parametrize("extra, loc, fragment", [
    ({"functions": [{"name": "f"}]}, ("functions",), "not supported"),
    ({"function_call": "auto"}, ("function_call",), "not supported"),
    ({"audio": {"voice": "alloy"}}, ("audio",), "not supported"),
    ({"frobnicate": 1}, ("frobnicate",), "Extra inputs"),
    ({"temperature": float("nan")}, ("temperature",), "finite"),
    ({"messages": [{"role": "user", "content": "a\ud800"}]}, (), "lone surrogate"),
])
def test_unimplemented_fields_are_rejected_by_name(extra, loc, fragment):
    from pydantic import ValidationError

    body = {"messages": [{"role": "user", "content": "hi"}]} | extra
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate(body)
    error = e.value.errors()[0]
    assert tuple(error["loc"]) == loc and fragment in error["msg"]


def test_neutral_values_of_unimplemented_fields_are_accepted():
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "assistant", "content": "x", "tool_calls": [], "refusal": None}],
         "tools": [], "tool_choice": "none", "parallel_tool_calls": True, "store": False,
         "modalities": ["text"], "service_tier": "auto"})
    assert req.tools == []


def test_swap_metrics_and_log_line():
    metrics = EngineMetrics("m")
    stats = SchedulerStats(num_running=1, num_waiting=0, kv_cache_usage=0.5,
                           prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=3,
                           num_free_blocks=5, num_blocks=9, num_swapped=1, num_swaps_out=3,
                           num_swaps_in=2, num_swapped_blocks=4)
    metrics.observe_scheduler_stats(stats)
    samples = {(s.name, s.labels.get("direction")): s.value
               for fam in text_string_to_metric_families(metrics.render().decode())
               for s in fam.samples}
    assert samples[("pagedllm:num_requests_swapped", None)] == 1
    assert samples[("pagedllm:num_swaps_total", "out")] == 3
    assert samples[("pagedllm:num_swaps_total", "in")] == 2
    assert "Swapped: 1 reqs (out 3, in 2)" in metrics.stats_log.log()
    metrics.mark_engine_dead()
    dead = {s.name: s.value for fam in text_string_to_metric_families(
        metrics.render().decode()) for s in fam.samples}
    assert dead["pagedllm:num_requests_swapped"] == 0 and dead["pagedllm:engine_alive"] == 0


def test_large_responses_are_built_and_encoded_off_the_event_loop():
    """json_response: a response above INLINE_BYTES is built and serialized in a worker
    thread (FastAPI would encode the model on the event loop) and sent as its JSON."""
    import asyncio
    import json
    import threading

    from starlette.responses import Response

    from pagedllm.entrypoints.openai.offload import INLINE_BYTES, Offloader
    from pagedllm.entrypoints.openai.protocol import (CompletionResponse,
                                                      CompletionResponseChoice,
                                                      prompt_logprobs_field)
    from pagedllm.outputs import Logprob

    serving = OpenAIServing.__new__(OpenAIServing)  # json_response needs the offloader only
    serving.offloader = Offloader(timeout_s=5)
    field = prompt_logprobs_field([None, {7: Logprob(float("-inf"), 3, "a"),
                                          8: Logprob(-0.5, 1, "b")}])
    threads = []

    def build() -> CompletionResponse:
        threads.append(threading.get_ident())
        return CompletionResponse(id="c", model="m", choices=[
            CompletionResponseChoice(index=0, text="x", prompt_logprobs=field)])

    async def respond(size: int):
        return await serving.json_response(build, size), threading.get_ident()

    try:
        small, loop_thread = asyncio.run(respond(INLINE_BYTES - 1))
        assert isinstance(small, CompletionResponse) and threads == [loop_thread]
        large, loop_thread = asyncio.run(respond(INLINE_BYTES))
        assert isinstance(large, Response) and threads[1] != loop_thread
        body = json.loads(large.body)
        assert body == json.loads(small.model_dump_json())
        assert body["choices"][0]["prompt_logprobs"] == [None, {
            "7": {"logprob": -9999.0, "rank": 3, "decoded_token": "a"},
            "8": {"logprob": -0.5, "rank": 1, "decoded_token": "b"}}]
    finally:
        serving.offloader.shutdown()
