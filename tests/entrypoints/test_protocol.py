"""Request models -> SamplingParams, and the metrics registry, without a server."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from pagedllm.engine.core_proc import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.openai.serving_common import OpenAIServing
from pagedllm.errors import InvalidRequestError
from pagedllm.json_limits import MAX_JSON_DEPTH, nesting_depth
from pagedllm.metrics import EngineMetrics
from pagedllm.request import Request
from pagedllm.sampling_params import (RequestOutputKind, SamplingParams,
                                      StructuredOutputsParams)

REPO_ROOT = Path(__file__).resolve().parents[2]


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


def test_openai_identifiers_are_accepted():
    """safety_identifier and prompt_cache_key (OpenAI's chat API, sent by agents) are
    taken like `user`, with nothing to do; a wrong type is still a 400."""
    from pydantic import ValidationError

    body = {"messages": [{"role": "user", "content": "hi"}], "user": "u",
            "safety_identifier": "hashed-user", "prompt_cache_key": "session-1"}
    req = ChatCompletionRequest.model_validate(body)
    assert (req.safety_identifier, req.prompt_cache_key) == ("hashed-user", "session-1")
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate(body | {"prompt_cache_key": ["x"]})
    assert tuple(e.value.errors()[0]["loc"]) == ("prompt_cache_key",)


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


def _nested(depth: int) -> list:
    """A list nested `depth` levels deep (the innermost one empty)."""
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def test_request_values_nest_at_most_max_json_depth():
    # The body is level 1 and `chat_template_kwargs` level 2: its value may nest 98 more.
    messages = [{"role": "user", "content": "x"}]
    ChatCompletionRequest(messages=messages, chat_template_kwargs={"x": _nested(98)})
    with pytest.raises(ValueError, match=r"chat_template_kwargs\.x(\[0\]){98} is nested "
                                         rf"more than {MAX_JSON_DEPTH} levels deep"):
        ChatCompletionRequest(messages=messages, chat_template_kwargs={"x": _nested(99)})
    # ~1000 deep took the recursive walk past Python's recursion limit (a 500).
    with pytest.raises(ValueError, match="nested more than"):
        ChatCompletionRequest(messages=messages, chat_template_kwargs={"x": _nested(5000)})


def test_json_texts_in_a_request_nest_at_most_max_json_depth():
    deep = json.dumps(_nested(MAX_JSON_DEPTH + 1))
    too_deep_for_python = "[" * 5000 + "]" * 5000  # json.loads: RecursionError
    for text in (deep, too_deep_for_python):
        with pytest.raises(InvalidRequestError, match="structured_outputs.json is nested"):
            StructuredOutputsParams(json=text)
        with pytest.raises(ValueError, match=r"arguments\n.*the JSON text is nested"):
            ChatCompletionRequest(messages=[
                {"role": "user", "content": "x"},
                {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                      "function": {"name": "f",
                                                                   "arguments": text}}]},
                {"role": "tool", "tool_call_id": "c", "content": "r"}])
    with pytest.raises(InvalidRequestError, match="structured_outputs.json is nested"):
        StructuredOutputsParams(json={"a": _nested(MAX_JSON_DEPTH)})  # offline: no body check
    StructuredOutputsParams(json=json.dumps({"type": "array", "items": {}}))


def test_a_requests_constraint_is_read_off_the_loop_once_for_all_its_prompts(monkeypatch):
    import asyncio
    import threading

    from pagedllm.entrypoints.openai.offload import Offloader

    serving = OpenAIServing.__new__(OpenAIServing)  # read_constraint needs the offloader only
    serving.offloader = Offloader(timeout_s=5)
    built_in = []
    original = StructuredOutputsParams.__post_init__
    monkeypatch.setattr(StructuredOutputsParams, "__post_init__",
                        lambda self: built_in.append(threading.get_ident()) or original(self))

    async def read(kwargs: dict) -> int:
        await serving.read_constraint(kwargs)
        return threading.get_ident()

    try:
        kwargs = {"structured_outputs": {"json": {"type": "object"}}, "temperature": 0.0}
        loop_thread = asyncio.run(read(kwargs))
        assert len(built_in) == 1 and built_in[0] != loop_thread
        constraint = kwargs["structured_outputs"]
        assert isinstance(constraint, StructuredOutputsParams)
        params = [OpenAIServing.sampling_params(kwargs | {"max_tokens": n}, False)
                  for n in (1, 2, 3)]
        assert all(p.structured_outputs is constraint for p in params)
        assert len(built_in) == 1  # not once a prompt
        with pytest.raises(InvalidRequestError, match="invalid structured_outputs"):
            asyncio.run(read({"structured_outputs": {"regexp": "a"}}))
    finally:
        serving.offloader.shutdown()


def test_nesting_depth_stops_past_its_limit():
    assert [nesting_depth(v) for v in (3, "s", [], {}, [[()]], {"a": [1, {"b": {}}]})] == [
        0, 0, 1, 1, 3, 4]
    assert nesting_depth(_nested(500)) == 500
    assert nesting_depth(_nested(500), limit=10) == 11  # the first level past it


def test_a_constraints_cache_key_is_taken_once_and_travels_with_it(monkeypatch):
    import pickle

    from pagedllm import sampling_params

    schema = {"type": "object", "properties": {"b": {"type": "string"}, "a": {}}}
    params = StructuredOutputsParams(json=schema)
    dumps, real_dumps = [], json.dumps
    monkeypatch.setattr(sampling_params.json, "dumps",
                        lambda *a, **kw: dumps.append(1) or real_dumps(*a, **kw))
    key = params.cache_key()
    assert params.cache_key() is key and len(dumps) == 1
    assert key == ("json", real_dumps(schema, sort_keys=True), False)
    moved = pickle.loads(pickle.dumps(SamplingParams(structured_outputs=params)))
    assert moved.structured_outputs.cache_key() == key and len(dumps) == 1
    assert moved.structured_outputs == params  # the key is not part of its identity
    # Equal constraints give equal keys whatever their key order.
    again = StructuredOutputsParams(json=dict(reversed(schema.items())))
    assert again.cache_key() == key


@pytest.mark.parametrize("fields, fragment", [
    ({"regex": [[1]]}, "structured_outputs.regex must be a string, got list"),
    ({"json": [[1]]}, "structured_outputs.json must be a JSON text or object, got list"),
    ({"json_object": [[1]]}, "structured_outputs.json_object must be true or false"),
    ({"json_object": "yes"}, "structured_outputs.json_object must be true or false"),
    ({"regex": "a", "disable_any_whitespace": []}, "disable_any_whitespace must be true"),
    ({"choice": "ab"}, "structured_outputs.choice must be a list of strings, got str"),
])
def test_structured_outputs_fields_have_their_types(fields, fragment):
    # An unhashable value was a 500 (the compile cache's key); "yes" read as true.
    with pytest.raises(InvalidRequestError, match=re.escape(fragment)):
        StructuredOutputsParams(**fields)


def test_two_constraints_in_one_request_are_refused():
    chat = {"messages": [{"role": "user", "content": "x"}]}
    for fields in ({"guided_choice": ["yes"], "guided_regex": "[0-9]+"},
                   {"structured_outputs": {"regex": "a"}, "guided_json": {"type": "object"}},
                   {"guided_json": {}, "guided_regex": "a"}):
        for request in (CompletionRequest(prompt="x", **fields),
                        ChatCompletionRequest(**chat, **fields)):
            with pytest.raises(InvalidRequestError, match="give only one constraint"):
                request.structured_outputs_kwargs()
    request = ChatCompletionRequest(**chat, response_format={"type": "json_object"},
                                    guided_json={"type": "array"})
    with pytest.raises(InvalidRequestError, match="got response_format and guided_json"):
        request.structured_outputs_kwargs()


def test_text_parts_need_text_strings():
    for part in ({"type": "text", "text": 5}, {"type": "text", "text": None},
                 {"type": "text"}, {"text": "x"}):
        with pytest.raises(ValueError, match=r"content\[0\]"):
            ChatCompletionRequest(messages=[{"role": "user", "content": [part]}])
    ok = ChatCompletionRequest(messages=[{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert ok.messages[0].text() == "ab"


def test_a_list_reports_only_its_first_bad_item():
    # Each bad item of each union member was an error of its own: 900k for this prompt.
    with pytest.raises(ValidationError) as info:
        CompletionRequest(prompt=[{}] * 300_000)
    assert info.value.error_count() == 4  # the union's four members, one item each
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest(messages=[{}] * 10_000)
    assert info.value.error_count() == 1


def test_stream_options_need_stream():
    with pytest.raises(ValueError, match="stream_options is only allowed with stream"):
        CompletionRequest(prompt="x", stream_options={"include_usage": True})
    CompletionRequest(prompt="x", stream=True, stream_options={"include_usage": True})


def test_a_responses_input_without_messages_is_named_as_input():
    for items in ([], [{"type": "reasoning", "summary": [{"type": "summary_text",
                                                         "text": "hm"}]}]):
        with pytest.raises(InvalidRequestError, match="input has no message"):
            ResponsesRequest(input=items).to_chat_request()


# Run in a fresh interpreter: in this one, earlier tests have imported everything.
_NO_LAZY_IMPORTS = """
import json, sys
import pagedllm.entrypoints.openai.server  # what `pagedllm serve` imports before serving
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
schema = {"type": "object", "properties": {"a": {"type": "string"}}}
fn = {"name": "f", "parameters": schema}
bodies = [
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                             "tools": [{"type": "function", "function": fn}],
                             "tool_choice": "required",
                             "response_format": {"type": "json_schema",
                                                 "json_schema": {"name": "s", "schema": schema}}}),
    (CompletionRequest, {"prompt": "x", "structured_outputs": {"json": schema}}),
    (ResponsesRequest, {"input": "x", "tools": [{"type": "function"} | fn]}),
]
before = set(sys.modules)
for model, body in bodies:
    model.model_validate(body)
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def test_validating_requests_imports_nothing():
    """A module imported by the first request that needs it runs on the event loop
    (jsonschema, by the first `tools` schema: 75-180 ms in which /health and every
    stream stalled): what requests use is imported with the server."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH"))
                                        if p)
    result = subprocess.run([sys.executable, "-c", _NO_LAZY_IMPORTS], cwd=REPO_ROOT,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == []
