"""`pagedllm bench throughput`: offline, every request submitted at once.

Reports elapsed_s, requests_per_s, output_tokens_per_s, total_tokens_per_s and peak_rss_mb.
`--backend hf` runs the same workload through transformers' `generate` instead
(bench/hf_backend.py); `--backend both` runs pagedllm then HF and adds the speed-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time
from typing import Any

from pagedllm.bench.common import (add_engine_bench_args, add_workload_args,
                                   counter_changes, emit, engine_counters, lora_setup,
                                   result_of, spec_decode_line, spec_decode_stats,
                                   workload_from_args)
from pagedllm.engine.arg_utils import EngineArgs


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser)
    add_engine_bench_args(parser)
    parser.add_argument("--backend", choices=("pagedllm", "hf", "both"), default="pagedllm",
                        help="pagedllm, transformers' generate (hf), or both for the speed-up")
    parser.add_argument("--hf-batch-sizes", default="1,8,32,64",
                        help="static batch sizes the hf backend tries (comma-separated); "
                             "the fastest on a short probe runs the workload")
    parser.add_argument("--no-warmup", action="store_true",
                        help="skip the short untimed request run before measuring")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample the workload at this temperature (default 0: greedy, "
                             "as the shared workloads are defined)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="and with this top_p (sampled runs only)")


def run_pagedllm(ns: argparse.Namespace, engine_args: EngineArgs) -> dict[str, Any]:
    from pagedllm import LLM, SamplingParams

    engine_args, lora = lora_setup(ns, engine_args)
    llm = LLM(skip_tokenizer_init=ns.skip_tokenizer_init, **dataclasses.asdict(engine_args))
    config = llm.llm_engine.config
    requests = workload_from_args(ns, config.model.hf_config.vocab_size)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    detokenize = not ns.skip_tokenizer_init
    params = [SamplingParams(temperature=ns.temperature, top_p=ns.top_p,
                             max_tokens=r.max_tokens, ignore_eos=True, detokenize=detokenize)
              for r in requests]
    if not ns.no_warmup:
        # One short request first: one-time costs (first allocations, lazy imports) are
        # start-up, not throughput. Its prompt shares no prefix with the workload's.
        warm = [int(t) % config.model.hf_config.vocab_size for t in range(7, 7 + 32)]
        llm.generate([{"prompt_token_ids": warm}],
                     SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                    detokenize=detokenize), use_tqdm=False,
                     lora_request=lora)
    before = engine_counters(llm.llm_engine)
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    changes = counter_changes(engine_counters(llm.llm_engine), before)
    num_scheduled = changes["num_scheduled_tokens_total"]
    # Each prompt token and each output token but the last is computed once at least;
    # the rest were computed again after a recompute preemption (exact without prefix
    # caching, whose hits are never computed).
    num_needed = sum(len(r.prompt_token_ids) + r.max_tokens - 1 for r in requests)
    extra = {"model": config.model.path, "dtype": config.model.dtype,
             "enable_prefix_caching": config.cache.enable_prefix_caching,
             "num_threads": config.device.num_threads, "lora_path": ns.lora_path,
             # CPU seconds of this process per wall second: ~num_threads when the machine
             # is ours; lower means other processes took cores from the run.
             "cpu_utilization": cpu / elapsed,
             "num_cached_prompt_tokens": sum(o.num_cached_tokens or 0 for o in outputs),
             "preemption_mode": config.scheduler.preemption_mode,
             "num_preemptions": changes["num_preemptions"],
             "num_swaps_out": changes["num_swaps_out"],
             "num_recomputed_tokens": (None if config.cache.enable_prefix_caching
                                       or num_scheduled is None
                                       else num_scheduled - num_needed),
             "data_parallel_size": config.parallel.data_parallel_size,
             **spec_decode_stats(config, changes)}
    del llm, outputs
    gc.collect()
    return result_of("pagedllm", requests, num_output, elapsed, extra)


def run(ns: argparse.Namespace, engine_args: EngineArgs) -> dict[str, Any]:
    if ns.lora_path and ns.backend != "pagedllm":
        raise ValueError("--lora-path runs with --backend pagedllm only")
    if ns.backend == "hf":
        from pagedllm.bench.hf_backend import run_hf

        result = run_hf(ns, engine_args)
    else:
        result = run_pagedllm(ns, engine_args)
        if ns.backend == "both":
            from pagedllm.bench.hf_backend import run_hf

            hf = run_hf(ns, engine_args)
            result["hf"] = hf
            result["speedup_vs_hf"] = result["output_tokens_per_s"] / hf["output_tokens_per_s"]
    emit(result, "throughput", _summary(result))
    return result


def _summary(r: dict[str, Any]) -> list[str]:
    lines = [f"backend:              {r['backend']}",
             f"requests:             {r['num_requests']}  (prompt tokens {r['num_prompt_tokens']}"
             f", output tokens {r['num_output_tokens']})",
             f"elapsed:              {r['elapsed_s']:.2f} s",
             f"requests/s:           {r['requests_per_s']:.2f}",
             f"output tokens/s:      {r['output_tokens_per_s']:.1f}",
             f"total tokens/s:       {r['total_tokens_per_s']:.1f}",
             f"peak RSS:             {r['peak_rss_mb']:.0f} MB"]
    if r.get("num_preemptions"):
        lines.append(f"preemptions:          {r['num_preemptions']} ({r['preemption_mode']}"
                     f", {r['num_swaps_out']} swapped out, recomputed tokens "
                     f"{r['num_recomputed_tokens']})")
    lines += spec_decode_line(r)
    if "hf_batch_size" in r:
        lines.append(f"hf batch size:        {r['hf_batch_size']}")
    if "hf" in r:
        lines.append(f"hf output tokens/s:   {r['hf']['output_tokens_per_s']:.1f} "
                     f"(batch size {r['hf']['hf_batch_size']})")
        lines.append(f"speed-up vs hf:       {r['speedup_vs_hf']:.1f}x")
    return lines
