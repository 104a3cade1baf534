#!/usr/bin/env python3
"""Where a batch-1 decode step's time goes on a GPU: wall time per step, the GPU time of
the replayed graph (CUDA events), and the host's Python profile (cProfile, top entries).

    python3 scripts/gpu/profile_decode.py [--model smollm2-135m|llama-3.2-1b] [--tokens N]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gpu  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.2-1b", choices=sorted(bench_gpu.MODELS))
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--compile", action="store_true", help="torch.compile the forward")
    ap.add_argument("--profile", action="store_true", help="print cProfile's top entries")
    ap.add_argument("--sync", action="store_true", help="async_scheduling off")
    args = ap.parse_args()
    from pagedllm import LLM, SamplingParams

    path = Path(tempfile.mkdtemp()) / args.model
    model, _ = bench_gpu.build_model(bench_gpu.MODELS[args.model], path)
    del model
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    llm = LLM(str(path), device="cuda", dtype="bfloat16", max_model_len=1024,
              max_num_seqs=64, gpu_memory_utilization=0.5, skip_tokenizer_init=True,
              compile=args.compile, **({"async_scheduling": False} if args.sync else {}))
    startup = time.perf_counter() - t0
    runner = llm.llm_engine.engine_core.executor.runner
    gpu_ms: list[float] = []
    run = runner.graphs.replay

    def timed_run(bucket, *a):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = run(bucket, *a)
        end.record()
        end.synchronize()
        gpu_ms.append(start.elapsed_time(end))
        return out

    prompt = {"prompt_token_ids": list(range(1, 129))}
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    plain = time.perf_counter() - t0
    runner.graphs.replay = timed_run
    llm.generate([prompt], params, use_tqdm=False)
    runner.graphs.replay = run
    prof = cProfile.Profile()
    prof.enable()
    t0 = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    profiled = time.perf_counter() - t0
    prof.disable()
    gpu_ms.sort()
    batch = json.loads((Path(__file__).parent / "workloads" / "batch64.json").read_text())
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in batch]
    many = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True)
            for r in batch]
    llm.generate(prompts[:8], many[:8], use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, many, use_tqdm=False)
    batch_s = time.perf_counter() - t0
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{args.model} compile={args.compile} sync={args.sync}: start-up {startup:.1f} s; "
          f"batch-1 decode "
          f"{args.tokens} tokens in {plain * 1e3:.1f} ms = {plain / args.tokens * 1e3:.3f} "
          f"ms/step ({args.tokens / plain:.0f} tok/s); graph replay (GPU, median) "
          f"{gpu_ms[len(gpu_ms) // 2]:.3f} ms; under cProfile "
          f"{profiled / args.tokens * 1e3:.3f} ms/step; batch64 {num_out / batch_s:.0f} "
          f"output tok/s")
    if not args.profile:
        return 0
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(25)
        print(out.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
