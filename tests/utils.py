"""Helpers for tests: tiny random HF models and a transformers greedy reference."""

from __future__ import annotations

import random
from pathlib import Path

import torch


def save_tiny_model(path: Path, config, seed: int = 0, dtype=torch.float32) -> Path:
    """Build a random `transformers` model from `config`, save it as safetensors."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init of norms is all-ones; perturb every parameter so bugs cannot hide.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.to(dtype).save_pretrained(path)
    return path


def random_prompts(n: int, vocab_size: int, min_len: int, max_len: int,
                   seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(min_len, max_len))]
            for _ in range(n)]


def hf_greedy(model_path: Path, prompts: list[list[int]], max_new_tokens: int,
              ) -> list[list[int]]:
    """transformers' own generate, greedy, float32, one prompt at a time (no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                               pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs


def hf_greedy_no_eos(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Plain argmax decoding with transformers' forward + its KV cache, never stopping at
    EOS and never masking it (generate's min_new_tokens would mask EOS, changing argmax)."""
    out_ids: list[int] = []
    with torch.no_grad():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(max_new_tokens):
            nxt = int(out.logits[0, -1].argmax())
            out_ids.append(nxt)
            out = model(torch.tensor([[nxt]]), past_key_values=out.past_key_values,
                        use_cache=True)
    return out_ids
