"""Tool calling in the chat API: the parsers (any chunking gives the same calls), the
request checks (400s naming the field), the plan of each tool_choice, and one live
server (the bundled SmolLM2 with a tools-aware --chat-template) driven by the `openai`
client: forced calls (named, "required") validate against their schemas, streams
assemble to the same calls, and conversations with calls and results render.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from pydantic import ValidationError

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.serve_config import ServeConfig
from pagedllm.entrypoints.openai.tool_calling import AUTO_NEEDS_FLAGS, plan_tools
from pagedllm.entrypoints.openai.tool_parsers import get_tool_parser
from pagedllm.entrypoints.openai.tool_parsers.base import (ParsedDelta, ToolParser,
                                                           assemble_calls, parse_all)
from pagedllm.entrypoints.openai.tool_parsers.guided import (NamedToolParser,
                                                             RequiredToolParser)
from pagedllm.errors import ConfigError, InvalidRequestError
from tests.entrypoints.utils import MODEL_NAME, RemoteServer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                  "unit": {"$ref": "#/$defs/unit"}},
                   "required": ["city", "unit"], "additionalProperties": False,
                   "$defs": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {
        "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
        "additionalProperties": False}}}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"],
           "get_time": TIME["function"]["parameters"]}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def hermes() -> ToolParser:
    return get_tool_parser("hermes")()


def llama3() -> ToolParser:
    return get_tool_parser("llama3_json")()


def calls_of(delta: ParsedDelta) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in assemble_calls(delta.tool_calls)]


def parse_chunked(parser: ToolParser, text: str, size: int) -> ParsedDelta:
    out = ParsedDelta()
    for i in range(0, len(text), size):
        out.extend(parser.feed(text[i:i + size]))
    return out.extend(parser.finish())


# ------------------------------------------------------------------ parsers

HERMES_CASES = [
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', "", [("f", {"a": 1})]),
    ('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n'
     '<tool_call>{"name": "g", "arguments": {"s": "x y"}}</tool_call>', "",
     [("f", {"a": 1}), ("g", {"s": "x y"})]),
    ('Let me check.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>', "Let me check.",
     [("f", {})]),
    ('A <tool_call>{"name": "f", "arguments": {}}</tool_call> then B', "A then B",
     [("f", {})]),
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call>\n\nDone.\n', "Done.\n",
     [("f", {})]),
    # Malformed: not JSON, not a call object, arguments not an object.
    ("Hi <tool_call>{not json}</tool_call> bye", "Hi <tool_call>{not json}</tool_call> bye",
     []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>',
     []),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
    # Left open at the end: a complete object still counts, a truncated one is content.
    ('<tool_call>{"name": "f", "arguments": {"a": 2}}', "", [("f", {"a": 2})]),
    ('ok <tool_call>{"name": "f", "argu', 'ok <tool_call>{"name": "f", "argu', []),
    # Arguments given as a JSON string; a closing tag inside an argument string.
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 3}"}</tool_call>', "",
     [("f", {"a": 3})]),
    ('<tool_call>{"name": "f", "arguments": {"s": "</tool_call>"}}</tool_call>', "",
     [("f", {"s": "</tool_call>"})]),
    # Plain text, including a partial marker at the very end, is content exactly.
    ("Just text.\n", "Just text.\n", []),
    ("a < b and <tool", "a < b and <tool", []),
]

LLAMA3_CASES = [
    ('{"name": "f", "parameters": {"a": 1}}', "", [("f", {"a": 1})]),
    ('<|python_tag|>{"name": "f", "parameters": {"a": "}"}}', "", [("f", {"a": "}"})]),
    ('{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"b": [1, 2]}}', "",
     [("f", {}), ("g", {"b": [1, 2]})]),
    (' {"name": "f", "arguments": {}}\n{"name": "g", "parameters": {}}', "",
     [("f", {}), ("g", {})]),
    # Malformed: prose that starts with a brace, a truncated object, trailing junk.
    ("{curly} is a word", "{curly} is a word", []),
    ('{"name": "f", "parame', '{"name": "f", "parame', []),
    ('{"name": "f", "parameters": {}}; and more', "and more", [("f", {})]),
    ('{"name": 5, "parameters": {}}', '{"name": 5, "parameters": {}}', []),
    ("The weather is fine.", "The weather is fine.", []),
    ("<|python", "<|python", []),
]


MISTRAL_CASES = [
    ('[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}]', "", [("f", {"a": 1})]),
    ('[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"s": "]"}}]',
     "", [("f", {}), ("g", {"s": "]"})]),
    # [TOOL_CALLS] is a special token: skipped from the text by default.
    (' [{"name": "f", "arguments": {"a": [1, 2]}}]', "", [("f", {"a": [1, 2]})]),
    ('[{"name": "f", "arguments": {}}] Done.', "Done.", [("f", {})]),
    # Not calls: a list that is prose, a truncated call, plain text.
    ("[1] First, preheat the oven.", "[1] First, preheat the oven.", []),
    ('[TOOL_CALLS] [{"name": "f", "argu', '[TOOL_CALLS] [{"name": "f", "argu', []),
    ("The weather is fine.", "The weather is fine.", []),
    ("[TOOL_CAL", "[TOOL_CAL", []),
]

PHI4_MINI_CASES = [
    ('functools[{"name": "f", "arguments": {"a": 1}}]', "", [("f", {"a": 1})]),
    (' functools[{"name": "f", "arguments": {}}, {"name": "g", "parameters": {"s": "]"}}]'
     " Done.", "Done.", [("f", {}), ("g", {"s": "]"})]),
    # Not calls: a bare list (Phi-4-mini always writes functools), a truncated call,
    # plain text, a partial opener.
    ('[{"name": "f", "arguments": {}}]', '[{"name": "f", "arguments": {}}]', []),
    ('functools[{"name": "f", "argu', 'functools[{"name": "f", "argu', []),
    ("The weather is fine.", "The weather is fine.", []),
    ("functoo", "functoo", []),
]

PYTHONIC_CASES = [
    ('[get_weather(city="Paris", unit="celsius")]', "",
     [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("[f(a=1, b=[1, 'x'], c={'k': None}, d=True), g()]", "",
     [("f", {"a": 1, "b": [1, "x"], "c": {"k": None}, "d": True}), ("g", {})]),
    ('<|python_start|>[f(s="a ] b")]<|python_end|>', "", [("f", {"s": "a ] b"})]),
    # What follows the list is content.
    ("  [f(x=-2.5)]\nDone.", "\nDone.", [("f", {"x": -2.5})]),
    ("[f(a=1)]<|python_e", "", [("f", {"a": 1})]),
    # Not calls (content as generated): prose, positional or non-literal arguments, a
    # list left open, an empty list, a list of values.
    ("Paris is sunny.", "Paris is sunny.", []),
    ("[f(1)]", "[f(1)]", []),
    ("[f(a=os.system('x'))]", "[f(a=os.system('x'))]", []),
    ("[f(a=1", "[f(a=1", []),
    ("[]", "[]", []),
    ("[1, 2, 3]", "[1, 2, 3]", []),
    ("<|python_st", "<|python_st", []),
]


# The schemas that type qwen3_coder's parameters (its values are text).
CODER_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "ratio": {"type": "number"},
        "hot": {"type": "boolean"}, "tags": {"type": "array"}, "opts": {"type": "object"},
        "zip": {"type": "string"}, "maybe": {"type": ["integer", "null"]}}}}}]


def call_xml(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


QWEN3_CODER_CASES = [
    ("Let me check." + call_xml("f", city="Paris", days="3"), "Let me check.",
     [("f", {"city": "Paris", "days": 3})]),
    # Each value as its schema's type; a value that does not parse stays text.
    (call_xml("f", ratio="2.5", hot="True", tags='["a", 1]', opts="{'k': None}",
              zip="02139", days="three", maybe="null"), "",
     [("f", {"ratio": 2.5, "hot": True, "tags": ["a", 1], "opts": {"k": None},
             "zip": "02139", "days": "three", "maybe": None})]),
    # Multi-line text kept (one newline trimmed at each end); an unknown tool's and an
    # unknown parameter's values are text.
    (call_xml("f", city="line one\nline two\n") + call_xml("g", n="7"), "",
     [("f", {"city": "line one\nline two\n"}), ("g", {"n": "7"})]),
    # A call left open at the end counts once its function closed.
    ("<tool_call>\n<function=f>\n<parameter=days>\n1\n</parameter>\n</function>", "",
     [("f", {"days": 1})]),
    # Not calls: JSON inside the markers, text between parameters, a function left open.
    ('<tool_call>{"name": "f"}</tool_call>', '<tool_call>{"name": "f"}</tool_call>', []),
    ("<tool_call><function=f>hello<parameter=a>1</parameter></function></tool_call>",
     "<tool_call><function=f>hello<parameter=a>1</parameter></function></tool_call>", []),
    ("<tool_call><function=f><parameter=a>1", "<tool_call><function=f><parameter=a>1",
     []),
    ("The weather is fine.", "The weather is fine.", []),
]


def qwen3_coder() -> ToolParser:
    return get_tool_parser("qwen3_coder")(CODER_TOOLS)


def mistral() -> ToolParser:
    return get_tool_parser("mistral")()


def pythonic() -> ToolParser:
    return get_tool_parser("pythonic")()


def phi4_mini() -> ToolParser:
    return get_tool_parser("phi4_mini_json")()


PARSER_CASES = {hermes: HERMES_CASES, llama3: LLAMA3_CASES, mistral: MISTRAL_CASES,
                pythonic: PYTHONIC_CASES, qwen3_coder: QWEN3_CODER_CASES,
                phi4_mini: PHI4_MINI_CASES}


def test_vllms_other_parser_names_read_the_same_formats():
    for alias, name in (("llama4_json", "llama3_json"), ("llama4_pythonic", "pythonic"),
                        ("qwen3_xml", "qwen3_coder")):
        assert get_tool_parser(alias) is get_tool_parser(name)


@pytest.mark.parametrize("make,text,content,calls",
                         [(make, *case) for make, cases in PARSER_CASES.items()
                          for case in cases])
def test_parser(make, text, content, calls):
    parsed = parse_all(make(), text)
    assert parsed.content == content and calls_of(parsed) == calls


@pytest.mark.parametrize("make,text", [(make, case[0]) for make, cases in PARSER_CASES.items()
                                       for case in cases])
@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_streaming_gives_the_same_calls(make, text, size):
    """Fed in pieces (1 = character by character), a parser releases the same content
    and calls as over the whole text."""
    whole = parse_all(make(), text)
    pieces = parse_chunked(make(), text, size)
    assert pieces.content == whole.content
    assert calls_of(pieces) == calls_of(whole)


def test_streamed_calls_are_openai_deltas():
    parser = hermes()
    text = ('Sure.<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
            '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    deltas = [d for ch in text for d in parser.feed(ch).tool_calls]
    deltas += parser.finish().tool_calls
    assert [d.index for d in deltas] == [0, 1]
    assert all(d.id.startswith("call_") and len(d.id) == 29 for d in deltas)
    assert deltas[0].id != deltas[1].id and deltas[0].name == "f"
    assert json.loads(deltas[0].arguments) == {"a": 1}


def test_hermes_holds_back_a_possible_marker():
    parser = hermes()
    assert parser.feed("Hello <tool").content == "Hello"  # the space and "<tool" wait
    assert parser.feed("box> x").content == " <toolbox> x"  # not a marker after all
    assert parser.feed(" <tool_call>").content == ""
    done = parser.feed('{"name": "f", "arguments": {}}</tool_call>\n')
    assert [c.name for c in done.tool_calls] == ["f"] and done.content == ""
    assert parser.finish().content == ""  # whitespace after a call is dropped


def test_required_parser_reads_the_guided_array():
    text = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]'
    for size in (1, 4, len(text)):
        parsed = parse_chunked(RequiredToolParser(), text, size)
        assert calls_of(parsed) == [("f", {"a": 1}), ("g", {})] and parsed.content == ""
    # Cut short by max_tokens: the complete calls stay, the rest is content.
    cut = parse_all(RequiredToolParser(), '[{"name": "f", "parameters": {}}, {"name": "g"')
    assert calls_of(cut) == [("f", {})] and cut.content == '{"name": "g"'


def test_named_parser_streams_the_arguments():
    parser = NamedToolParser("f")
    first = parser.feed('{"a"')
    assert first.tool_calls[0].name == "f" and first.tool_calls[0].id.startswith("call_")
    rest = parser.feed(": 1}").extend(parser.finish())
    assert [d.id for d in rest.tool_calls] == [None]
    assert calls_of(first.extend(rest)) == [("f", {"a": 1})]


# ------------------------------------------------------------------ request checks

def validate(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER} | fields)


CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


@pytest.mark.parametrize("fields,loc,fragment", [
    ({"tool_choice": "required"}, ("tool_choice",), "`tools` must be set"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     ("tool_choice",), "`tools` must be set"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     ("tool_choice",), "'nope' is not one of the specified `tools`"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, ("tool_choice",), "must be \"none\""),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, ("tool_choice",),
     "a named tool_choice must be exactly"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": 5}}},
     ("tool_choice",), "a named tool_choice must be exactly"),
    ({"tools": [WEATHER, WEATHER]}, ("tools",), "defined twice"),
    ({"tools": [{"type": "function"}]}, ("tools", 0, "function"), "required"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, ("tools", 0, "type"), ""),
    ({"tools": [{"type": "function", "function": {"name": ""}}]},
     ("tools", 0, "function", "name"), "empty"),
    ({"tools": [{"type": "function", "function": {"name": "f",
                                                  "parameters": {"type": "nonsense"}}}]},
     ("tools", 0, "function", "parameters"), "not a valid JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"minimum": "x"}}}}}]},
     ("tools", 0, "function", "parameters"), "not a valid JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f",
                                                  "parameters": {"type": "array"}}}]},
     ("tools", 0, "function", "parameters"), "must describe an object"),
    ({"messages": [{"role": "tool", "content": "sunny"}]}, ("messages", 0), "tool_call_id"),
    ({"messages": [{"role": "tool", "tool_call_id": "call_1"}]}, ("messages", 0), "content"),
    ({"messages": [{"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]},
     ("messages",), "must answer a call"),
    ({"messages": USER + [{"role": "assistant", "content": None, "tool_calls": [CALL]}]},
     ("messages",), "no answer to 'call_1'"),
    ({"messages": USER + [{"role": "assistant", "tool_calls": [CALL]},
                          {"role": "user", "content": "well?"}]},
     ("messages",), "must be followed by tool messages"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, ("messages", 0),
     "only allowed in assistant messages"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "call_1"}]},
     ("messages", 0), "only allowed in tool messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        CALL | {"function": {"name": "f", "arguments": "{oops"}}]}]},
     ("messages", 0, "tool_calls", 0, "function", "arguments"), "JSON"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        CALL | {"function": {"name": "f", "arguments": "[1]"}}]}]},
     ("messages", 0, "tool_calls", 0, "function", "arguments"), "JSON object"),
    ({"functions": [{"name": "f"}]}, ("functions",), "not supported"),
])
def test_bad_tool_requests_name_the_field(fields, loc, fragment):
    with pytest.raises(ValidationError) as e:
        validate(**fields)
    error = e.value.errors()[0]
    assert tuple(error["loc"]) == loc and fragment in error["msg"], error


def test_valid_tool_conversation_and_defaults():
    req = validate(messages=USER + [
        {"role": "assistant", "content": None, "tool_calls": [CALL, CALL | {"id": "call_2"}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_2"},
        {"role": "tool", "content": "warm", "tool_call_id": "call_1"}], tools=[WEATHER])
    assert req.effective_tool_choice == "auto"
    assert validate().effective_tool_choice == "none"
    assert validate(tools=[], tool_choice="none").effective_tool_choice == "none"
    # Templates get the arguments decoded (HF templates expect a mapping).
    rendered = req.messages[1].template_dict()
    assert rendered["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert rendered["content"] == ""
    assert req.messages[2].template_dict()["tool_call_id"] == "call_2"


AUTO = ServeConfig(enable_auto_tool_choice=True, tool_call_parser="hermes").auto_tool_parser()


def test_plan_per_tool_choice():
    with pytest.raises(InvalidRequestError) as e:
        plan_tools(validate(tools=[WEATHER]), None)
    assert str(e.value) == AUTO_NEEDS_FLAGS and "--enable-auto-tool-choice" in str(e.value)
    auto = plan_tools(validate(tools=[WEATHER]), AUTO)
    assert auto.constraint is None and type(auto.make_parser()).__name__ == "HermesToolParser"
    none = plan_tools(validate(tools=[WEATHER], tool_choice="none"), None)
    assert none.make_parser is None
    assert none.template_tools[0]["function"]["name"] == "get_weather"
    named = plan_tools(validate(tools=[WEATHER, TIME], tool_choice={
        "type": "function", "function": {"name": "get_time"}}), None)
    assert named.constraint == {"json": SCHEMAS["get_time"], "disable_any_whitespace": True}
    assert named.is_named
    required = plan_tools(validate(tools=[WEATHER, TIME], tool_choice="required",
                                   parallel_tool_calls=False), None)
    schema = required.constraint["json"]
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert "$defs" not in WEATHER["function"]["parameters"]["properties"]  # not mutated
    assert schema["$defs"] == {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}
    # The array schema accepts exactly the calls it describes.
    good = [{"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}]
    jsonschema.validate(good, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {"city": "Rome"}}], schema)


PLUGIN = '''
from pagedllm.entrypoints.openai.tool_parsers.base import ParsedDelta, ToolParser


class Shout(ToolParser):
    """CALL name args: the whole output is one call."""

    name = "shout"

    def __init__(self):
        super().__init__()
        self.text = ""

    def feed(self, text):
        self.text += text
        return ParsedDelta()

    def finish(self):
        name, _, args = self.text.removeprefix("CALL ").partition(" ")
        return ParsedDelta(tool_calls=[self.new_call(name, args)])
'''


def test_custom_parsers_by_plugin_file_or_qualified_name(tmp_path):
    """--tool-parser-plugin FILE with --tool-call-parser naming its parser's `name`
    (vLLM's plugins), or a ToolParser subclass by qualified name; what cannot be found
    is a start-up error saying what was looked for."""
    plugin = tmp_path / "my_parsers.py"
    plugin.write_text(PLUGIN)
    config = ServeConfig(enable_auto_tool_choice=True, tool_call_parser="shout",
                         tool_parser_plugin=str(plugin))
    plan = plan_tools(validate(tools=[WEATHER]), config.auto_tool_parser())
    parsed = parse_all(plan.make_parser(), 'CALL get_weather {"city": "Rome"}')
    assert calls_of(parsed) == [("get_weather", {"city": "Rome"})]
    by_name = ServeConfig(enable_auto_tool_choice=True, tool_call_parser=(
        "pagedllm.entrypoints.openai.tool_parsers.hermes:HermesToolParser"))
    assert by_name.auto_tool_parser().__name__ == "HermesToolParser"
    for kw, fragment in (
            ({"tool_call_parser": "nope", "tool_parser_plugin": str(plugin)},
             "nor does the plugin"),
            ({"tool_call_parser": "pkg.shout"}, "tool call parser 'pkg.shout': cannot import"),
            ({"tool_call_parser": "json:dumps"}, "is not a subclass of"),
            ({"tool_call_parser": "no_such_mod:P"}, "No module named"),
            ({"tool_call_parser": "shout", "tool_parser_plugin": str(tmp_path / "x.py")},
             "is not a file")):
        with pytest.raises(ConfigError, match=fragment):
            ServeConfig(enable_auto_tool_choice=True, **kw).auto_tool_parser()
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')")
    with pytest.raises(ConfigError, match="failed to load: RuntimeError: boom"):
        ServeConfig(enable_auto_tool_choice=True, tool_call_parser="shout",
                    tool_parser_plugin=str(broken)).auto_tool_parser()
    with pytest.raises(ConfigError, match="--tool-parser-plugin needs --tool-call-parser"):
        ServeConfig(tool_parser_plugin=str(plugin))


def test_plan_conflicts():
    with pytest.raises(InvalidRequestError, match="cannot be combined"):
        plan_tools(validate(tools=[WEATHER], tool_choice="required",
                            response_format={"type": "json_object"}), None)
    other_unit = json.loads(json.dumps(TIME))
    other_unit["function"]["parameters"]["$defs"] = {"unit": {"enum": ["kelvin"]}}
    with pytest.raises(InvalidRequestError, match="defined differently"):
        plan_tools(validate(tools=[WEATHER, other_unit], tool_choice="required"), None)


def test_serve_config_tool_flags(tmp_path):
    with pytest.raises(ValueError, match="requires --tool-call-parser"):
        ServeConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="unknown tool call parser 'granite'; choose one"):
        ServeConfig(tool_call_parser="granite")
    with pytest.raises(ValueError, match="neither a template nor a file"):
        ServeConfig(chat_template=str(tmp_path / "missing.jinja"))
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}")
    loaded = ServeConfig(chat_template=str(path)).load_chat_template()
    assert loaded == "{{ messages[0].content }}"
    assert ServeConfig(chat_template="{{ 1 }}").load_chat_template() == "{{ 1 }}"


# ------------------------------------------------------------------ live server

# ChatML with a tools section, calls rendered as Hermes <tool_call> blocks (arguments
# must arrive as a mapping for `tojson` to print an object) and results as tool turns.
TOOLS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call these functions:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>{"name": "{{ call.function.name }}", \
"arguments": {{ call.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>tool
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

API_KEY = "tool-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = tmp_path_factory.mktemp("templates") / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    srv = RemoteServer(["--dtype", "float32", "--max-model-len", "1024",
                        "--num-kv-blocks", "128", "--max-num-seqs", "8",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        "--chat-template", str(template), "--trust-request-chat-template"],
                       api_key=API_KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def chat(client, **kwargs):
    kwargs = {"max_tokens": 64, "temperature": 0} | kwargs
    return client.chat.completions.create(model=MODEL_NAME, messages=USER, **kwargs)


def assemble_stream(stream) -> tuple[str, list[dict], str | None]:
    """(content, calls, finish_reason) of a streamed choice 0, checking that each call's
    first delta names it and later ones only add arguments."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.index not in calls:
                assert d.id.startswith("call_") and d.type == "function" and d.function.name
                calls[d.index] = {"id": d.id, "name": d.function.name,
                                  "arguments": d.function.arguments or ""}
            else:
                assert d.id is None and d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def call_list(message) -> list[dict]:
    return [{"name": c.function.name, "arguments": json.loads(c.function.arguments)}
            for c in message.tool_calls or []]


def test_named_tool_choice(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(client, tools=[WEATHER, TIME], tool_choice=named)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's for a forced function
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
    # The same call, streamed.
    content, calls, finish = assemble_stream(chat(client, tools=[WEATHER, TIME],
                                                  tool_choice=named, stream=True))
    assert content == "" and finish == "stop"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", call.function.arguments)]


def test_required_tool_choice(client):
    r = chat(client, tools=[WEATHER, TIME], tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in call_list(choice.message):
        jsonschema.validate(call["arguments"], SCHEMAS[call["name"]])
    ids = [c.id for c in choice.message.tool_calls]
    assert len(set(ids)) == len(ids)
    content, calls, finish = assemble_stream(chat(client, tools=[WEATHER, TIME],
                                                  tool_choice="required", stream=True))
    assert finish == "tool_calls" and content == ""
    assert [{"name": c["name"], "arguments": json.loads(c["arguments"])}
            for c in calls] == call_list(choice.message)
    single = chat(client, tools=[WEATHER, TIME], tool_choice="required",
                  parallel_tool_calls=False)
    assert len(single.choices[0].message.tool_calls) == 1


def test_auto_with_hermes_parser(client):
    """A 135M model seldom calls a tool by itself: only the shape is checked, and that a
    stream reads to the same message."""
    r = chat(client, tools=[WEATHER], max_tokens=24)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content is not None or choice.message.tool_calls
    for call in call_list(choice.message):
        assert isinstance(call["arguments"], dict)
    content, calls, finish = assemble_stream(chat(client, tools=[WEATHER], max_tokens=24,
                                                  stream=True))
    assert finish == choice.finish_reason and content == (choice.message.content or "")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (c["name"], c["arguments"]) for c in call_list(choice.message)]


def test_tool_choice_none_is_plain_text(client):
    r = chat(client, tools=[WEATHER], tool_choice="none", max_tokens=8)
    assert r.choices[0].message.tool_calls is None
    assert isinstance(r.choices[0].message.content, str)


def test_conversation_with_calls_and_results(server, client):
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc", "type": "function",
             "function": {"name": "get_weather",
                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "21 degrees, sunny"}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=[WEATHER],
                                       tool_choice="none", max_tokens=8, temperature=0)
    assert r.choices[0].message.content is not None
    # What the template made of it: the tools, the call's arguments as an object, the
    # result; /tokenize renders the same way.
    tokens = httpx.post(server.url + "/tokenize", headers=server.headers, json={
        "messages": messages, "tools": [WEATHER]}).json()["tokens"]
    assert len(tokens) == r.usage.prompt_tokens
    text = httpx.post(server.url + "/detokenize", headers=server.headers,
                      json={"tokens": tokens}).json()["prompt"]
    assert '"name": "get_weather"' in text and "You may call these functions" in text
    assert '"arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>' in text
    assert "<tool_response>21 degrees, sunny</tool_response>" in text


def test_request_chat_template_sees_tools_and_decoded_arguments(server, client):
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}{{ m.role }}:{{ m.content }}"
                "{% for c in m.tool_calls or [] %}{{ c.function.arguments.city }}{% endfor %}"
                "|{% endfor %}")
    messages = USER + [
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Rome", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "hot"}]
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=[WEATHER, TIME], tool_choice="none",
        max_tokens=2, extra_body={"chat_template": template})
    expected = ("[get_weather][get_time]user:What is the weather in Paris?|"
                "assistant:Rome|tool:hot|")
    count = httpx.post(server.url + "/tokenize", headers=server.headers,
                       json={"prompt": expected, "add_special_tokens": False}).json()["count"]
    assert r.usage.prompt_tokens == count


@pytest.mark.parametrize("template,expected", [
    # Loops over a content: every content given as parts (a string one too).
    ("{% for m in messages %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}"
     "{% endfor %}", "[hi][a][b]"),
    ("{% for m in messages %}{% set c = m.content %}{% for p in c %}<{{ p.text }}>"
     "{% endfor %}{% endfor %}", "<hi><a><b>"),
    # Prints a content: every content one string.
    ("{% for m in messages %}[{{ m['content'] }}]{% endfor %}", "[hi][ab]"),
])
def test_contents_are_given_as_the_template_reads_them(server, template, expected):
    """--chat-template-content-format auto (the default): string or parts, as the
    (request's) template reads a content."""
    messages = [{"role": "user", "content": "hi"},
                {"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "text", "text": "b"}]}]
    ids = httpx.post(server.url + "/tokenize", headers=server.headers, json={
        "model": MODEL_NAME, "messages": messages, "chat_template": template,
        "add_generation_prompt": False}).json()["tokens"]
    text = httpx.post(server.url + "/detokenize", headers=server.headers,
                      json={"model": MODEL_NAME, "tokens": ids}).json()["prompt"]
    assert text == expected


@pytest.mark.parametrize("body,param,needle", [
    ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice", "not one of the specified `tools`"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": 5}}}}}]}, "tools",
     "not a valid JSON schema"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "tool_call_id"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, None, "cannot be combined"),
])
def test_http_400s(server, body, param, needle):
    r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers, timeout=30,
                   json={"model": MODEL_NAME, "messages": USER, "max_tokens": 4} | body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["param"] == param, error


def test_qwen3_coder_reads_the_request_tools():
    """The server hands the request's tools to a parser that types values by them."""
    config = ServeConfig(enable_auto_tool_choice=True, tool_call_parser="qwen3_coder")
    plan = plan_tools(validate(tools=CODER_TOOLS), config.auto_tool_parser())
    parsed = parse_all(plan.make_parser(), call_xml("f", days="4", city="5"))
    assert calls_of(parsed) == [("f", {"days": 4, "city": "5"})]
