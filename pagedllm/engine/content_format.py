"""How a chat template reads a message's content: one string, or OpenAI's list of parts.

Chat requests may send a message's content either way; templates read one of them.
Most text models' templates print `message['content']` as a string; others (every
multimodal one, and newer text ones) loop over it as parts ({"type": "text", "text":
...}). --chat-template-content-format chooses ("string",
"openai"); "auto", the default, looks at the template as vLLM does: one that loops over
a message's content (directly, or over a variable set from it) reads parts. Only the
template's syntax tree is read; nothing in it runs. The server reads contents into
its message models; `LLM.chat` passes its dicts through `as_content_format`.
"""

from __future__ import annotations

from typing import Any, Literal

import jinja2
from jinja2 import nodes

from pagedllm.errors import InvalidRequestError

ContentFormat = Literal["string", "openai"]
CONTENT_FORMATS = ("auto", "string", "openai")


def detect_content_format(template: str | None) -> ContentFormat:
    """"openai" when `template` loops over a message's content, else "string" (also for
    no template, or one whose syntax this parser does not take: rendering reports it)."""
    if not template:
        return "string"
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        tree = env.parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"
    # Variables set from a content (`{% set content = message['content'] %}`).
    aliases = {target.name for assign in tree.find_all(nodes.Assign)
               if _is_content(assign.node)
               for target in [assign.target] if isinstance(target, nodes.Name)}
    for loop in tree.find_all(nodes.For):
        node = _unfiltered(loop.iter)
        if _is_content(node) or (isinstance(node, nodes.Name) and node.name in aliases):
            return "openai"
    return "string"


def _unfiltered(node: nodes.Node) -> nodes.Node:
    """`x | selectattr(...) | list` -> x."""
    while isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None:
        node = node.node
    return node


def _is_content(node: nodes.Node) -> bool:
    """`something['content']` or `something.content`."""
    node = _unfiltered(node)
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    return isinstance(node, nodes.Getattr) and node.attr == "content"


def as_content_format(messages: list[dict[str, Any]], content_format: ContentFormat,
                      ) -> list[dict[str, Any]]:
    """`messages` with each content as the template reads it: text parts joined into
    one string, or a string as one text part. InvalidRequestError for a part that is
    not text (a text model's messages)."""
    converted = []
    for message in messages:
        content = message.get("content")
        if content_format == "string" and isinstance(content, list):
            kinds = [part.get("type") if isinstance(part, dict) else type(part).__name__
                     for part in content]
            other = [kind for kind in kinds if kind != "text"]
            if other:
                raise InvalidRequestError(f"only text content parts are supported by this "
                                          f"model, got {other[0]!r}")
            message = {**message, "content": "".join(str(part.get("text", ""))
                                                     for part in content)}
        elif content_format == "openai" and isinstance(content, str):
            message = {**message, "content": [{"type": "text", "text": content}]}
        converted.append(message)
    return converted
