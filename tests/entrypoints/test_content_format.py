"""How the chat template reads a message's content, found in its syntax tree: a loop
over a content (directly, through a filter, or through a variable set from it) means
OpenAI's parts, anything else one string."""

from __future__ import annotations

import pytest

from pagedllm.config import default_model_path
from pagedllm.entrypoints.openai.content_format import detect_content_format

PARTS = ("{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}"
         "{% endfor %}")


@pytest.mark.parametrize("template,expected", [
    (PARTS, "openai"),
    ("{% for m in messages %}{% for p in m.content | selectattr('type', 'equalto', 'text') %}"
     "{{ p.text }}{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{% set c = m['content'] %}{% for p in c %}{{ p.text }}"
     "{% endfor %}{% endfor %}", "openai"),
    # Llama 3.2's shape: a string printed, else parts looped over.
    ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
     "{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}{% endfor %}",
     "openai"),
    ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] | trim }}{% endfor %}",
     "string"),
    ("{% for m in messages %}{% for c in m['tool_calls'] %}{{ c }}{% endfor %}{% endfor %}",
     "string"),
    ("{% for m in messages %}{{ m.content", "string"),  # not valid: rendering says so
    ("", "string"),
    (None, "string"),
])
def test_detected_format(template, expected):
    assert detect_content_format(template) == expected


def test_the_bundled_models_template_reads_a_string():
    from pagedllm.loader import load_tokenizer

    template = load_tokenizer(default_model_path()).chat_template
    assert isinstance(template, str) and detect_content_format(template) == "string"


def test_an_unknown_format_is_refused():
    from pagedllm.entrypoints.openai.serve_config import ServeConfig
    from pagedllm.errors import ConfigError

    with pytest.raises(ConfigError, match="auto, string, openai, got 'parts'"):
        ServeConfig(chat_template_content_format="parts")
