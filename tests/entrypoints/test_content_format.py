"""How the chat template reads a message's content, found in its syntax tree: a loop
over a content (directly, through a filter, or through a variable set from it) means
OpenAI's parts, anything else one string."""

from __future__ import annotations

import pytest

from pagedllm.config import default_model_path
from pagedllm.engine.content_format import detect_content_format

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


def test_offline_chat_gives_contents_as_the_template_reads_them():
    """LLM.chat: text parts joined for a template that prints a content (the bundled
    model's), a string made one part for a template that loops over parts; the same
    prompt either way."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.errors import InvalidRequestError

    llm = LLM(max_model_len=256)
    params = SamplingParams(max_tokens=1, temperature=0)
    as_string = [{"role": "user", "content": "Hello there"}]
    as_parts = [{"role": "user", "content": [{"type": "text", "text": "Hello "},
                                             {"type": "text", "text": "there"}]}]
    prompts = {llm.chat(conv, params, use_tqdm=False)[0].prompt
               for conv in (as_string, as_parts)}
    assert len(prompts) == 1 and "Hello there" in prompts.pop()
    parts_template = ("{% for m in messages %}{% for p in m['content'] %}[{{ p['text'] }}]"
                      "{% endfor %}{% endfor %}")
    for conv, expected in ((as_string, "[Hello there]"), (as_parts, "[Hello ][there]")):
        out = llm.chat(conv, params, use_tqdm=False, chat_template=parts_template,
                       add_generation_prompt=False)[0]
        assert out.prompt == expected
    forced = llm.chat(as_string, params, use_tqdm=False, chat_template=parts_template,
                      chat_template_content_format="string", add_generation_prompt=False)
    assert forced[0].prompt == "[][][][][][][][][][][]"  # a string looped over: its chars
    with pytest.raises(InvalidRequestError, match="only text content parts"):
        llm.chat([{"role": "user", "content": [{"type": "input_audio", "data": "x"}]}],
                 params, chat_template_content_format="string")
    with pytest.raises(InvalidRequestError, match="chat_template_content_format"):
        llm.chat(as_string, params, chat_template_content_format="parts")
