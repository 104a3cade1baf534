"""The transformers baseline of `bench throughput`: `generate` over left-padded static
batches, greedy, exactly max_tokens new tokens per request (EOS masked until then).

Several batch sizes are probed on a short run; the fastest runs the whole workload.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch

from pagedllm.bench.common import BenchRequest, result_of, workload_from_args
from pagedllm.engine.arg_utils import EngineArgs

# New tokens per request in the batch-size probe.
_PROBE_TOKENS = 32


def load_hf_model(path: str, dtype: torch.dtype, device: str = "cpu",
                  trust_remote_code: bool = False) -> Any:
    """transformers' model on `device` (the engine's: the baseline runs where pagedllm
    does); `trust_remote_code`: the directory's own model code, where it has some."""
    from transformers import AutoModelForCausalLM

    if path.endswith(".gguf"):
        # transformers dequantizes the GGUF itself.
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                     trust_remote_code=trust_remote_code)
    return model.to(device).eval()


def pad_id_of(config: Any) -> int:
    for key in ("pad_token_id", "eos_token_id"):
        value = getattr(config, key, None)
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


@torch.inference_mode()
def generate_batch(model: Any, batch: list[BenchRequest], max_new: int, pad_id: int) -> None:
    """One static batch, prompts left-padded to the longest."""
    width = max(len(r.prompt_token_ids) for r in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):
        input_ids[i, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
        mask[i, width - len(r.prompt_token_ids):] = 1
    device = model.device
    model.generate(input_ids.to(device), attention_mask=mask.to(device), do_sample=False,
                   max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=pad_id)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the caller times the batch


def pick_batch_size(model: Any, requests: list[BenchRequest], sizes: list[int],
                    pad_id: int) -> tuple[int, dict[int, float]]:
    """The size with the most output tokens/s on a short probe of the workload's first
    requests (and the probe rates)."""
    generate_batch(model, requests[:1], 2, pad_id)  # warm-up
    rates: dict[int, float] = {}
    for size in sizes:
        batch = requests[:size]
        new = min(_PROBE_TOKENS, max(r.max_tokens for r in batch))
        start = time.perf_counter()
        generate_batch(model, batch, new, pad_id)
        rates[size] = len(batch) * new / (time.perf_counter() - start)
    return max(rates, key=rates.get), rates


def run_hf(ns: argparse.Namespace, engine_args: EngineArgs) -> dict[str, Any]:
    config = engine_args.create_engine_config()
    dtype = getattr(torch, config.model.dtype)
    requests = workload_from_args(ns, config.model.hf_config.vocab_size)
    model = load_hf_model(config.model.path, dtype, config.device.device,
                          config.model.trust_remote_code)
    pad_id = pad_id_of(model.config)
    sizes = sorted({min(int(s), len(requests)) for s in ns.hf_batch_sizes.split(",")
                    if s.strip()})
    batch_size, rates = pick_batch_size(model, requests, sizes, pad_id)
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        # Every request of a static batch runs to the batch's longest max_tokens; only
        # each request's own max_tokens count as output.
        generate_batch(model, batch, max(r.max_tokens for r in batch), pad_id)
    elapsed = time.perf_counter() - start
    num_output = sum(r.max_tokens for r in requests)
    extra = {"model": config.model.path, "dtype": config.model.dtype,
             "hf_batch_size": batch_size,
             "hf_probe_output_tokens_per_s": {str(k): v for k, v in rates.items()}}
    return result_of("hf", requests, num_output, elapsed, extra)
