"""Mistral tool calls (vLLM's `mistral`: Mistral 7B Instruct v0.3, Mistral Nemo, Mistral
Small 3.x with their chat templates):

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]

The output is calls when it starts (after whitespace) with a JSON array of call
objects, after `[TOOL_CALLS]` or not: that tag is a special token, in the text only
when the request keeps special tokens (skip_special_tokens false). Text that starts
with "[" but is no call array ("[1] First, ...") is content.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.json_calls import JsonCallSequenceParser

TOOL_CALLS_TAG = "[TOOL_CALLS]"


class MistralToolParser(JsonCallSequenceParser):

    def __init__(self) -> None:
        super().__init__(openers=(f"{TOOL_CALLS_TAG} [", f"{TOOL_CALLS_TAG}[", "["),
                         separator=",", closer="]",
                         argument_keys=("arguments", "parameters"))
