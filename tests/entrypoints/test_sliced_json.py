"""sliced_json: the JSON of Responses objects written a slice of logprobs at a time
(and of logprobs kept as JSON) equals pydantic's own, as parsed."""

from __future__ import annotations

import json

from pagedllm.entrypoints.openai.protocol import ChatLogprobTop, ChatLogprobToken
from pagedllm.entrypoints.openai.sliced_json import (RawJSON, fields_json,
                                                        fragments_json, logprobs_fragment,
                                                        to_json)
from pagedllm.entrypoints.openai.responses_protocol import (FunctionCallOutput,
                                                            OutputMessage, OutputText,
                                                            ReasoningItem, ReasoningText,
                                                            ResponseObject)


def _logprobs(n: int) -> list[ChatLogprobToken]:
    return [ChatLogprobToken(token=f'"é{i}\\', logprob=-i / 10, bytes=list(f"é{i}".encode()),
                             top_logprobs=[ChatLogprobTop(token=f"t{j}", logprob=-j)
                                           for j in range(3)])
            for i in range(n)]


def _response(part: OutputText) -> ResponseObject:
    return ResponseObject(id="r", created_at=0, status="completed", model="m",
                          tools=[{"a": [1]}],
                          output=[ReasoningItem(id="rs", content=[ReasoningText(text="x")]),
                                  OutputMessage(id="m", status="completed", content=[part]),
                                  FunctionCallOutput(id="f", call_id="c", name="n",
                                                     arguments='{"a": 1}',
                                                     status="completed")])


def test_sliced_json_equals_pydantics():
    logprobs = _logprobs(200)  # 4 slices of 64 entries
    response = _response(OutputText(text='a "quoted" text', logprobs=logprobs))
    assert json.loads(to_json(response)) == json.loads(response.model_dump_json())
    assert json.loads(to_json(logprobs)) == [lp.model_dump(mode="json") for lp in logprobs]
    assert to_json([]) == "[]"


def test_logprobs_kept_as_json_are_written_in_their_place():
    logprobs = _logprobs(70)
    fragments = [logprobs_fragment(logprobs[:5]), logprobs_fragment([]),
                 logprobs_fragment(logprobs[5:])]
    kept = _response(OutputText(text="t", logprobs_json=fragments_json(fragments)))
    full = _response(OutputText(text="t", logprobs=logprobs))
    assert json.loads(to_json(kept)) == json.loads(full.model_dump_json())
    # pydantic's own dump never names the JSON field (nor holds the logprobs).
    assert "logprobs_json" not in kept.model_dump_json()


def test_event_fields_mix_plain_values_models_and_raw_json():
    part = OutputText(text="t")
    event = json.loads(fields_json({"type": "x", "sequence_number": 2, "text": "ü\n",
                                    "part": part, "logprobs": RawJSON("[1, 2]"),
                                    "empty": []}))
    assert event == {"type": "x", "sequence_number": 2, "text": "ü\n", "empty": [],
                     "part": part.model_dump(mode="json"), "logprobs": [1, 2]}
    assert json.loads(fields_json({"part": part})) == {"part": part.model_dump(mode="json")}


def test_a_chat_choice_with_logprobs_is_written_as_pydantic_writes_it():
    from pagedllm.entrypoints.openai.protocol import (ChatCompletionResponseChoice,
                                                      ChatLogprobs, ChatResponseMessage)

    choice = ChatCompletionResponseChoice(
        index=0, message=ChatResponseMessage(content="x"), finish_reason="stop",
        logprobs=ChatLogprobs(content=_logprobs(150)))
    assert json.loads(to_json(choice)) == json.loads(choice.model_dump_json())
