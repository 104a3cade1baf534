"""Phi-4-mini tool calls (vLLM's `phi4_mini_json`; Phi-4-mini-instruct runs as
Phi3ForCausalLM):

    functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]

The output is calls when it starts (after whitespace) with `functools[` and a JSON
array of call objects; anything else, including a bare "[", is content.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.json_calls import JsonCallSequenceParser


class Phi4MiniJsonToolParser(JsonCallSequenceParser):

    def __init__(self) -> None:
        super().__init__(openers=("functools[",), separator=",", closer="]",
                         argument_keys=("arguments", "parameters"))
