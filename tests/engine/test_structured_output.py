"""Structured output (xgrammar) with the bundled SmolLM2: JSON schemas, regex, choice,
EBNF grammar, json_object and a structural tag, all in one batch next to an
unconstrained request."""

from __future__ import annotations

import json
import re

import pytest

from pagedllm import (GuidedDecodingParams, InvalidRequestError, SamplingParams,
                      StructuredOutputsParams)

SCHEMAS = [
    {"type": "object",
     "properties": {"name": {"type": "string", "maxLength": 16},
                    "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object",
     "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Rome"]},
                    "population": {"type": "number"}, "capital": {"type": "boolean"}},
     "required": ["city", "population", "capital"]},
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    {"type": "object",
     "properties": {"title": {"type": "string", "maxLength": 20},
                    "tags": {"type": "array", "maxItems": 3,
                             "items": {"type": "string", "maxLength": 10}}},
     "required": ["title", "tags"]},
]
WEATHER_TAG = {"type": "structural_tag", "format": {
    "type": "tag", "begin": "<weather>", "end": "</weather>",
    "content": {"type": "json_schema", "json_schema": SCHEMAS[1]}}}
PROMPTS = ["Describe a person in JSON:", "Give facts about a European city as JSON:",
           "List a few numbers as a JSON array:", "A blog post as JSON:"]
EOS = 2  # <|im_end|>


def check_schema(value, schema: dict) -> None:
    """The subset of JSON Schema used above (jsonschema itself when installed)."""
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    if jsonschema is not None:
        jsonschema.validate(value, schema)
        return
    kind = schema["type"]
    types = {"object": dict, "array": list, "string": str, "boolean": bool,
             "integer": int, "number": (int, float)}
    assert isinstance(value, types[kind]), (value, schema)
    if kind in ("integer", "number"):
        assert not isinstance(value, bool)
    if "enum" in schema:
        assert value in schema["enum"]
    if kind == "string" and "maxLength" in schema:
        assert len(value) <= schema["maxLength"]
    if kind == "array":
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value))
        for item in value:
            check_schema(item, schema["items"])
    if kind == "object":
        assert set(schema.get("required", ())) <= set(value)
        for key, item in value.items():
            check_schema(item, schema["properties"][key])


@pytest.fixture(scope="module")
def outputs(default_llm):
    constraints = [StructuredOutputsParams(json=s) for s in SCHEMAS[:3]]
    constraints.append(StructuredOutputsParams(json=json.dumps(SCHEMAS[3]),
                                               disable_any_whitespace=True))
    constraints += [
        StructuredOutputsParams(regex=r"\d{3}-\d{4}"),
        StructuredOutputsParams(choice=["yes", "no", "maybe so"]),
        StructuredOutputsParams(grammar='root ::= ("cat" | "dog") " says " ("hi" | "bye")'),
        StructuredOutputsParams(json_object=True),
    ]
    prompts = PROMPTS + ["My phone number is", "Is the sky blue? Answer:",
                         "An animal speaks:", "Some data in JSON:"]
    params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=c)
              for c in constraints]
    # An unconstrained neighbour: masks must stay on their own rows.
    prompts.append("The capital of France is")
    params.append(SamplingParams(temperature=0, max_tokens=4))
    # A structural tag: the tagged block, its content a JSON schema's.
    prompts.append("Report the weather:")
    params.append(SamplingParams(temperature=0, max_tokens=60, structured_outputs=(
        StructuredOutputsParams(structural_tag=WEATHER_TAG))))
    return default_llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_json_schema(outputs, i):
    completion = outputs[i].outputs[0]
    # The grammar ends the output: EOS is allowed only once the value is complete.
    assert completion.finish_reason == "stop" and completion.token_ids[-1] == EOS
    check_schema(json.loads(completion.text), SCHEMAS[i])
    if i == 3:  # disable_any_whitespace: no free whitespace (no newlines, no indent)
        assert "\n" not in completion.text and "  " not in completion.text


def test_regex_choice_grammar_and_json_object(outputs):
    texts = [o.outputs[0].text for o in outputs[4:8]]
    assert re.fullmatch(r"\d{3}-\d{4}", texts[0])
    assert texts[1] in ("yes", "no", "maybe so")
    assert re.fullmatch(r"(cat|dog) says (hi|bye)", texts[2])
    assert isinstance(json.loads(texts[3]), (dict, list))
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs[4:8])
    assert "Paris" in outputs[8].outputs[0].text


def test_guided_decoding_is_vllms_older_name(default_llm, outputs):
    """SamplingParams(guided_decoding=GuidedDecodingParams(...)), as vLLM before 0.11
    spelled it, constrains alike; with structured_outputs too it is refused."""
    params = SamplingParams(temperature=0, max_tokens=60, guided_decoding=(
        GuidedDecodingParams(choice=["yes", "no", "maybe so"])))
    out = default_llm.generate(["Is the sky blue? Answer:"], params, use_tqdm=False)
    assert out[0].outputs[0].text == outputs[5].outputs[0].text
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(guided_decoding={"regex": "a"}, structured_outputs={"regex": "b"})


def test_structural_tag(outputs):
    completion = outputs[9].outputs[0]
    assert completion.finish_reason == "stop"
    match = re.fullmatch(r"<weather>(.*)</weather>", completion.text, re.DOTALL)
    assert match, completion.text
    check_schema(json.loads(match.group(1)), SCHEMAS[1])


def test_structural_tag_in_vllms_older_form():
    """{"structures": [{begin, schema, end}], "triggers"} is xgrammar's triggered_tags:
    free text, each trigger opening one of the tagged JSON blocks."""
    from pagedllm.sample.structured_output import structural_tag_text

    older = {"type": "structural_tag", "triggers": ["<f="],
             "structures": [{"begin": "<f=get>", "schema": SCHEMAS[0], "end": "</f>"}]}
    assert json.loads(structural_tag_text(older)) == {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<f="], "tags": [{
            "type": "tag", "begin": "<f=get>", "end": "</f>",
            "content": {"type": "json_schema", "json_schema": SCHEMAS[0]}}]}}


@pytest.mark.parametrize("kwargs", [{"json": '{"type": "object", "properties": 5'},
                                    {"regex": "(abc"}, {"grammar": "root ::= "},
                                    {"choice": []}, {"json": "{}", "regex": "a"},
                                    {"structural_tag": {"type": "structural_tag",
                                                        "format": {"type": "nope"}}},
                                    {"structural_tag": {"structures": [{"begin": "<a>"}],
                                                        "triggers": ["<a"]}},
                                    {"structural_tag": "[1, 2"}])
def test_invalid_constraints_rejected_up_front(default_llm, kwargs):
    with pytest.raises(InvalidRequestError, match="structured_outputs"):
        default_llm.generate(["x"], SamplingParams(
            structured_outputs=StructuredOutputsParams(**kwargs)), use_tqdm=False)
    assert not default_llm.llm_engine.has_unfinished_requests()


def test_the_engines_structured_outputs_config(outputs):
    """vLLM's structured_outputs_config: disable_any_whitespace for every JSON grammar
    (the same output as a request that asks for it itself); what pagedllm cannot do is
    refused by name."""
    from pagedllm import LLM
    from pagedllm.errors import ConfigError

    llm = LLM(structured_outputs_config={"backend": "xgrammar",
                                         "disable_any_whitespace": True})
    out = llm.generate([PROMPTS[3], PROMPTS[0]], SamplingParams(
        temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(
            json=json.dumps(SCHEMAS[3]))), use_tqdm=False)
    assert out[0].outputs[0].text == outputs[3].outputs[0].text
    assert "\n" not in out[1].outputs[0].text and "  " not in out[1].outputs[0].text
    assert out[1].outputs[0].text != outputs[0].outputs[0].text  # (that one has spaces)
    for config, match in (({"backend": "guidance"}, "guided_decoding_backend must be"),
                          ({"disable_additional_properties": True}, "guidance backend"),
                          ({"enable_in_reasoning": True}, "inside the reasoning"),
                          ({"disable_any_whitespace": "yes"}, "true or false"),
                          ({"whitespace": False}, r"unknown structured_outputs_config keys"),
                          ({"reasoning_parser": "qwen3"}, "disagree")):
        with pytest.raises(ConfigError, match=match):
            LLM(structured_outputs_config=config, reasoning_parser="deepseek_r1")
