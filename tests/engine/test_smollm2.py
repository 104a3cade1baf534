"""The bundled SmolLM2-135M-Instruct GGUF: loads, generates, and matches transformers
(which dequantizes the same GGUF itself) token for token in float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams, TextPrompt, TokensPrompt
from pagedllm.config import default_model_path
from tests.utils import hf_greedy_no_eos

PROMPTS = ["The capital of France is", "Here is a recipe for pancakes:\n1.",
           "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def llm():
    # Dequantized, as transformers runs the file (the native quantized path's int8
    # activations differ slightly: tests/engine/test_gguf_quantized.py).
    return LLM(dtype="float32", quantization="none")


def test_default_model_greedy_matches_transformers(llm):
    from transformers import AutoModelForCausalLM

    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    path = Path(default_model_path())
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                               dtype=torch.float32).eval()
    for out in outs:
        expected = hf_greedy_no_eos(ref, out.prompt_token_ids, 32)
        assert out.outputs[0].token_ids == expected, out.prompt
        assert out.outputs[0].text == llm.get_tokenizer().decode(expected,
                                                                 skip_special_tokens=True)


def test_chat_uses_template(llm):
    outs = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    tok = llm.get_tokenizer()
    prompt_text = tok.decode(outs[0].prompt_token_ids)
    assert "<|im_start|>user" in prompt_text and prompt_text.endswith("<|im_start|>assistant\n")
    assert "Paris" in outs[0].outputs[0].text


def test_vllms_prompt_types(llm):
    """TextPrompt / TokensPrompt (vllm.inputs' names) are the dict forms."""
    params = SamplingParams(temperature=0, max_tokens=4)
    text = "The capital of France is"
    ids = llm.get_tokenizer().encode(text)
    typed = llm.generate([TextPrompt(prompt=text), TokensPrompt(prompt_token_ids=ids)],
                         params, use_tqdm=False)
    plain = llm.generate([text, {"prompt_token_ids": ids}], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in typed] == [o.outputs[0].token_ids for o in plain]


def test_chat_continues_the_final_message(llm):
    """continue_final_message: the prompt ends inside the assistant's open message (no
    end-of-turn, no new assistant header) and the reply goes on from it."""
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is"}]
    outs = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False,
                    continue_final_message=True)
    assert outs[0].prompt.endswith("<|im_start|>assistant\nThe capital of France is")
    assert "Paris" in outs[0].outputs[0].text


def test_chat_renders_tools_through_the_template(llm):
    template = ("{% for tool in tools %}tool: {{ tool.function.name }}\n{% endfor %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    tools = [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]
    outs = llm.chat([{"role": "user", "content": "Weather in Paris?"}],
                    SamplingParams(temperature=0, max_tokens=2), use_tqdm=False,
                    chat_template=template, tools=tools)
    assert outs[0].prompt == "tool: get_weather\nuser: Weather in Paris?\n"


def test_sampling_with_seed_reproducible(llm):
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, seed=0)
    a = llm.generate(["Hello, my name is", "The capital of France is"], params,
                     use_tqdm=False)
    b = llm.generate(["The capital of France is"], params, use_tqdm=False)
    assert a[1].outputs[0].token_ids == b[0].outputs[0].token_ids
    assert all(o.outputs[0].text for o in a)


def test_eos_finishes_with_stop(llm):
    outs = llm.chat([{"role": "user", "content": "Say hi"}], SamplingParams(max_tokens=200,
                                                                         temperature=0),
                    use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "stop"
    assert outs[0].outputs[0].token_ids[-1] == 2
