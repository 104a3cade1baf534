"""Llama 3.1/3.2 JSON tool calls (vLLM's `llama3_json`):

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

The output is calls only when it starts (after whitespace) with `<|python_tag|>` or
"{"; the calls are JSON objects separated by ";" (or just whitespace), their arguments
under "parameters" (or "arguments"). Note `<|python_tag|>` is a special token: it is
in the text only when the request keeps special tokens (skip_special_tokens false);
without it the output starts with "{" and parses the same.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.json_calls import JsonCallSequenceParser

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(JsonCallSequenceParser):

    def __init__(self) -> None:
        super().__init__(openers=(PYTHON_TAG, ""), separator=";",
                         is_separator_optional=True,
                         argument_keys=("parameters", "arguments"))
