"""`pagedllm bench latency`: one request at a time.

Per iteration: ttft_s (request added -> first token), e2e_s (-> last token) and
decode_tokens_per_s ((output tokens - 1) / (e2e - ttft)); reported as medians with
p90/p99 over the iterations. startup_s is process start -> first token of the first
(warm-up) request: imports, model load, KV cache allocation and the first prefill.
Prefix caching is off by default here, so repeats of one prompt recompute it.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import psutil

from pagedllm.bench.common import (BenchRequest, add_engine_bench_args, add_workload_args,
                                   counter_changes, emit, engine_counters, load_dataset,
                                   lora_setup, peak_rss_mb, random_requests,
                                   spec_decode_line, spec_decode_stats, summarize)
from pagedllm.engine.arg_utils import EngineArgs


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser, lengths=False)
    add_engine_bench_args(parser)
    parser.add_argument("--input-len", type=int, default=128,
                        help="prompt tokens (random prompt; without --dataset)")
    parser.add_argument("--output-len", type=int, default=128,
                        help="tokens to generate (without --dataset)")
    parser.add_argument("--num-iters", type=int, default=5, help="measured requests")
    parser.add_argument("--num-iters-warmup", type=int, default=1,
                        help="untimed requests first (the first gives startup_s)")


def time_request(engine: Any, req_id: str, request: BenchRequest,
                 detokenize: bool = True, lora: Any = None) -> tuple[float, float, int]:
    """(ttft_s, e2e_s, output tokens) of one request run alone on `engine` (with the
    LoRA adapter `lora`, if given)."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True,
                            detokenize=detokenize)
    start = time.perf_counter()
    engine.add_request(req_id, {"prompt_token_ids": request.prompt_token_ids}, params,
                       lora_request=lora)
    ttft, num_tokens = None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            num_tokens = len(out.outputs[0].token_ids)
            if ttft is None and num_tokens:
                ttft = time.perf_counter() - start
    return ttft or float("nan"), time.perf_counter() - start, num_tokens


def run(ns: argparse.Namespace, engine_args: EngineArgs) -> dict[str, Any]:
    from pagedllm import LLM

    process_start = psutil.Process().create_time()  # epoch seconds
    engine_args, lora = lora_setup(ns, engine_args)
    llm = LLM(skip_tokenizer_init=ns.skip_tokenizer_init, **dataclasses.asdict(engine_args))
    engine, config = llm.llm_engine, llm.llm_engine.config
    if ns.dataset:
        requests = load_dataset(ns.dataset)[:ns.num_prompts or None]
    else:
        requests = random_requests(1, ns.input_len, ns.output_len,
                                   config.model.hf_config.vocab_size, ns.seed)
    ttfts, e2es, decode_rates = [], [], []
    startup_s = None
    before = engine_counters(engine)
    for i in range(ns.num_iters_warmup + ns.num_iters):
        if i == ns.num_iters_warmup:
            before = engine_counters(engine)
        request = requests[i % len(requests)]
        ttft, e2e, num_tokens = time_request(engine, f"latency-{i}", request,
                                             not ns.skip_tokenizer_init, lora)
        if startup_s is None:
            # Wall clock since the process began, at this first request's first token.
            startup_s = time.time() - process_start - (e2e - ttft)
        if i < ns.num_iters_warmup:
            continue
        ttfts.append(ttft)
        e2es.append(e2e)
        if num_tokens > 1:
            decode_rates.append((num_tokens - 1) / (e2e - ttft))
    result = {"model": config.model.path, "dtype": config.model.dtype,
              "num_iters": ns.num_iters, "num_threads": config.device.num_threads,
              "lora_path": ns.lora_path,
              "input_len": len(requests[0].prompt_token_ids),
              "output_len": requests[0].max_tokens,
              **summarize(ttfts, "ttft_s"), **summarize(decode_rates, "decode_tokens_per_s"),
              **summarize(e2es, "e2e_s"), "startup_s": startup_s, "peak_rss_mb": peak_rss_mb(),
              **spec_decode_stats(config, counter_changes(engine_counters(engine),
                                                          before))}
    emit(result, "latency", _summary(result))
    return result


def _summary(r: dict[str, Any]) -> list[str]:
    return [f"prompt / output tokens: {r['input_len']} / {r['output_len']}  "
            f"({r['num_iters']} iterations)",
            f"TTFT:               {r['ttft_s'] * 1e3:.1f} ms  (p90 {r['ttft_s_p90'] * 1e3:.1f},"
            f" p99 {r['ttft_s_p99'] * 1e3:.1f})",
            f"decode:             {r['decode_tokens_per_s']:.1f} tok/s  "
            f"(p90 {r['decode_tokens_per_s_p90']:.1f})",
            f"end to end:         {r['e2e_s']:.3f} s  (p90 {r['e2e_s_p90']:.3f})",
            f"start-up:           {r['startup_s']:.2f} s (process start -> first token)",
            f"peak RSS:           {r['peak_rss_mb']:.0f} MB", *spec_decode_line(r)]
