"""Parity checks shared by the model-family tests: a tiny random HF model, transformers'
greedy reference, and pagedllm's tokens and chosen-token logprobs compared against it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams
from tests.utils import (chosen_logprobs, hf_greedy_no_eos, hf_sequence_logprobs,
                         pagedllm_sequence_logprobs, random_prompts, save_tiny_model)

MAX_NEW = 16
VOCAB = 256
LOGPROB_ATOL = 1e-3


@dataclass
class TinyCase:
    """A saved tiny model with its transformers reference outputs."""

    path: Path
    hf_model: torch.nn.Module
    prompts: list[list[int]]
    # Greedy continuation of each prompt by transformers (never stopping at EOS).
    reference: list[list[int]]


def make_case(path: Path, config, num_prompts: int = 8, seed: int = 0) -> TinyCase:
    from transformers import AutoModelForCausalLM

    save_tiny_model(path, config, seed=seed)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts(num_prompts, VOCAB, 3, 41, seed=seed + 1)
    reference = [hf_greedy_no_eos(hf_model, p, MAX_NEW) for p in prompts]
    return TinyCase(path, hf_model, prompts, reference)


def generate(path: Path, prompts: list[list[int]], **engine_kw):
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, **engine_kw)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def assert_parity(case: TinyCase, logprob_chunk_size: int | None = None,
                  path: Path | None = None, **engine_kw) -> LLM:
    """pagedllm's greedy tokens equal transformers'; the chosen tokens' logprobs agree
    within LOGPROB_ATOL (pagedllm's computed over the sequence in `logprob_chunk_size`
    chunks, so cached-context attention is covered too)."""
    llm, outputs = generate(path or case.path, case.prompts, **engine_kw)
    assert outputs == case.reference
    for prompt, out in zip(case.prompts, outputs):
        seq = prompt + out
        ours = pagedllm_sequence_logprobs(llm, seq, logprob_chunk_size)
        theirs = hf_sequence_logprobs(case.hf_model, seq)
        torch.testing.assert_close(chosen_logprobs(ours, len(prompt), out),
                                   chosen_logprobs(theirs, len(prompt), out),
                                   atol=LOGPROB_ATOL, rtol=0)
    return llm


def rewrite_checkpoint(src: Path, dst: Path, rename, extra: dict | None = None) -> Path:
    """Copy a tiny model with its tensor names passed through `rename` (None drops one)
    and `extra` tensors added: checkpoints in the older layouts found on the Hub."""
    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(src / "model.safetensors")
    renamed = {new: t for name, t in tensors.items() if (new := rename(name)) is not None}
    save_file({**renamed, **(extra or {})}, dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps(json.loads((src / "config.json").read_text())))
    return dst
