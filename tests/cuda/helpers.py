"""Shared pieces of the CUDA tests: transformers' references computed on the same GPU,
the engine options that keep each engine small, and freeing the device between them."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

ON_GPU = torch.cuda.is_available()
# Every module of tests/cuda: marked `cuda`, and skipped cleanly without a GPU.
CUDA_MARKS = [pytest.mark.cuda,
              pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (torch.cuda)")]

# A forced block count: no memory profile, and engines of one test module do not size
# their caches against each other's leftovers (gpu_memory_utilization). 16-token blocks.
TINY_ENGINE_KW = dict(device="cuda", num_kv_blocks=128, block_size=16, max_num_seqs=16)


def free_cuda() -> None:
    """Drop unreachable engines / models (reference cycles included) and return their
    cached blocks to the device."""
    gc.collect()
    if ON_GPU:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def hf_model_cuda(path: Path | str, dtype: torch.dtype = torch.float32, **config_overrides):
    """transformers' model of a saved checkpoint on the GPU (eval mode), with its eager
    attention: on CUDA the default (sdpa) leaves out Gemma 2's score soft-cap, which
    the eager path applies (measured: Gemma 2's tokens differed from the first one)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    for key, value in config_overrides.items():
        setattr(cfg, key, value)
    model = AutoModelForCausalLM.from_pretrained(path, config=cfg, dtype=dtype,
                                                 attn_implementation="eager")
    return model.to("cuda").eval()


@torch.no_grad()
def hf_greedy_no_eos_cuda(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """tests/utils.py's `hf_greedy_no_eos` with its inputs on the model's device: argmax
    decoding through transformers' forward and KV cache, never stopping at EOS."""
    device = next(model.parameters()).device
    out_ids: list[int] = []
    out = model(torch.tensor([prompt_ids], device=device), use_cache=True)
    for _ in range(max_new_tokens):
        nxt = int(out.logits[0, -1].argmax())
        out_ids.append(nxt)
        out = model(torch.tensor([[nxt]], device=device), past_key_values=out.past_key_values,
                    use_cache=True)
    return out_ids


@torch.no_grad()
def hf_sequence_logprobs_cuda(model, token_ids: list[int]) -> torch.Tensor:
    """tests/utils.py's `hf_sequence_logprobs` on the model's device ([len, vocab] float32,
    returned on the CPU like `pagedllm_sequence_logprobs`)."""
    device = next(model.parameters()).device
    logits = model(torch.tensor([token_ids], device=device)).logits[0]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


def runner_of(llm):
    """The in-process worker's ModelRunner (uni executor)."""
    return llm.llm_engine.engine_core.executor.runner
