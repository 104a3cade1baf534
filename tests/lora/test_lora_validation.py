"""Bad LoRA requests and settings are refused up front, naming what is wrong; the engine
keeps serving."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm import LLM, InvalidRequestError, LoRARequest, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.lora.adapter import check_adapter
from tests.utils import save_tiny_lora, save_tiny_model, tiny_llama_config

SP = SamplingParams(max_tokens=2, temperature=0)
PROMPT = {"prompt_token_ids": [1, 2, 3]}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("lora_val") / "model", tiny_llama_config())


@pytest.fixture(scope="module")
def llm(model):
    return LLM(str(model), skip_tokenizer_init=True, enable_lora=True, max_lora_rank=8)


def _edit(path, config=None, tensors=None):
    """Rewrite an adapter's config (dict update) and tensors (function of the dict)."""
    if config is not None:
        cfg = json.loads((path / "adapter_config.json").read_text())
        cfg.update(config)
        (path / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        file = path / "adapter_model.safetensors"
        save_file(tensors(load_file(file)), file)
    return path


def _rename(old, new):
    return lambda t: {k.replace(old, new): v for k, v in t.items()}


CASES = {
    "no config": (lambda p: (p / "adapter_config.json").unlink(), "no adapter_config.json"),
    "bad json": (lambda p: (p / "adapter_config.json").write_text("{"), "not valid JSON"),
    "rank too large": (lambda p: _edit(p, {"r": 16}), "max_lora_rank (8)"),
    "rank not int": (lambda p: _edit(p, {"r": "4"}), "r must be a positive integer"),
    "dora": (lambda p: _edit(p, {"use_dora": True}), "use_dora"),
    "bias": (lambda p: _edit(p, {"bias": "all"}), "bias 'all'"),
    "modules_to_save": (lambda p: _edit(p, {"modules_to_save": ["lm_head"]}),
                        "modules_to_save"),
    "rank_pattern": (lambda p: _edit(p, {"rank_pattern": {"q_proj": 2}}), "rank_pattern"),
    "not lora": (lambda p: _edit(p, {"peft_type": "IA3"}), "peft_type 'IA3'"),
    "no weights": (lambda p: (p / "adapter_model.safetensors").unlink(),
                   "no adapter_model.safetensors"),
    "pickle only": (lambda p: (p / "adapter_model.safetensors").rename(
        p / "adapter_model.bin"), "adapter_model.bin is a pickle"),
    "garbage weights": (lambda p: (p / "adapter_model.safetensors").write_bytes(b"x" * 64),
                        "not a valid safetensors file"),
    "embedding": (lambda p: _edit(p, tensors=_rename("layers.0.self_attn.q_proj",
                                                     "embed_tokens")),
                  "'model.embed_tokens' is not a linear"),
    "layer out of range": (lambda p: _edit(p, tensors=_rename("layers.1.", "layers.7.")),
                           "below 2"),
    "wrong parent": (lambda p: _edit(p, tensors=_rename("self_attn.q_proj", "mlp.q_proj")),
                     "is not a linear"),
    "missing B": (lambda p: _edit(p, tensors=lambda t: {
        k: v for k, v in t.items() if "layers.0.self_attn.k_proj.lora_B" not in k}),
        "has no lora_B"),
    "wrong shape": (lambda p: _edit(p, tensors=lambda t: {
        k: (v[:, :5].contiguous() if k.endswith("q_proj.lora_A.weight") else v)
        for k, v in t.items()}),
        "expected [4, 64]"),
    "int weights": (lambda p: _edit(p, tensors=lambda t: {
        k: v.to(torch.int32) for k, v in t.items()}), "has dtype I32"),
    "other tensor": (lambda p: _edit(p, tensors=lambda t: {
        **t, "base_model.model.model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}),
        "is not a LoRA A or B weight"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_adapters_are_refused_by_name(tmp_path, model, llm, case):
    make_bad, message = CASES[case]
    adapter = save_tiny_lora(tmp_path / case.replace(" ", "_"), model)
    make_bad(adapter)
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        llm.generate(PROMPT, SP, use_tqdm=False,
                     lora_request=LoRARequest(case, 100 + sorted(CASES).index(case),
                                              str(adapter)))
    # Nothing was queued and the engine still serves.
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.generate(PROMPT, SP, use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_requests_and_settings_refused(tmp_path, model, llm):
    adapter = save_tiny_lora(tmp_path / "ok", model)
    plain = LLM(str(model), skip_tokenizer_init=True)
    with pytest.raises(InvalidRequestError, match="enable_lora=True"):
        plain.generate(PROMPT, SP, use_tqdm=False,
                       lora_request=LoRARequest("a", 1, str(adapter)))
    with pytest.raises(InvalidRequestError, match="lora_request must be a LoRARequest"):
        llm.generate(PROMPT, SP, use_tqdm=False, lora_request=[str(adapter)])
    with pytest.raises(InvalidRequestError, match="1 prompts but 2 lora requests"):
        llm.generate(PROMPT, SP, use_tqdm=False, lora_request=[None, None])
    # One id names one adapter.
    llm.generate(PROMPT, SP, use_tqdm=False, lora_request=LoRARequest("a", 1, str(adapter)))
    other = save_tiny_lora(tmp_path / "other", model, seed=9)
    with pytest.raises(InvalidRequestError, match="lora_int_id 1 already names"):
        llm.generate(PROMPT, SP, use_tqdm=False,
                     lora_request=LoRARequest("b", 1, str(other)))
    for kw, message in (({"lora_name": ""}, "lora_name"), ({"lora_int_id": 0}, "lora_int_id"),
                        ({"lora_int_id": True}, "lora_int_id"), ({"lora_path": ""}, "lora_path")):
        with pytest.raises(ValueError, match=message):
            LoRARequest(**{"lora_name": "a", "lora_int_id": 1, "lora_path": "x", **kw})
    for kw, message in (({"compile": True}, "compile=True"),
                        ({"max_loras": 2, "max_cpu_loras": 1}, "max_cpu_loras"),
                        ({"max_lora_rank": 0}, "max_lora_rank")):
        with pytest.raises(ValueError, match=message):
            EngineArgs(model=str(model), enable_lora=True, **kw).create_engine_config()


def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config

    path = save_tiny_model(tmp_path / "gpt2", GPT2Config(
        vocab_size=128, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    with pytest.raises(ValueError, match="not supported for GPT2LMHeadModel"):
        EngineArgs(model=str(path), enable_lora=True).create_engine_config()


def test_phi3_fused_modules_are_targets(tmp_path):
    """Phi-3 checkpoints (and PEFT adapters of them) name the fused qkv_proj and
    gate_up_proj: those are the targets there."""
    from transformers import Phi3Config

    cfg = Phi3Config(vocab_size=128, hidden_size=32, intermediate_size=64,
                     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=64, pad_token_id=0)
    path = save_tiny_model(tmp_path / "phi3", cfg)
    adapter = save_tiny_lora(tmp_path / "a", path, targets=("qkv_proj", "gate_up_proj"))
    spec = check_adapter(str(adapter), cfg, 16)
    assert spec.modules == ("model.layers.0.mlp.gate_up_proj",
                            "model.layers.0.self_attn.qkv_proj")
    with pytest.raises(InvalidRequestError, match="one of qkv_proj"):
        check_adapter(str(save_tiny_lora(tmp_path / "b", path, targets=("o_proj",))),
                      Phi3Config(**{**cfg.to_dict(), "num_hidden_layers": 0}), 16)
