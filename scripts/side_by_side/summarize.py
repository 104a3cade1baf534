"""Tables of a side-by-side run (run.sh's result folder): per round, each engine's figure
and pagedllm's ratio to the other engine in the same round.

    python scripts/side_by_side/summarize.py RESULTS_DIR ROUNDS
"""

import json
import sys
from pathlib import Path


def load(path: Path):
    """A JSON result file, or None where the run left nothing readable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def llamacpp(path: Path) -> tuple[float | None, float | None]:
    """(decode tok/s of tg128, first-token ms of pp128) of a llama-bench JSON file."""
    rows = load(path) or []
    decode = next((r["avg_ts"] for r in rows if r["n_gen"] > 0), None)
    prefill = next((r["avg_ts"] for r in rows if r["n_prompt"] > 0), None)
    return decode, (128 / prefill * 1e3 if prefill else None)


def fmt(x: float | None, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def with_dtype(result: dict) -> str:
    """A throughput figure and the dtype it ran in (`--quantization none` is float32 on a
    CPU without AVX512-BF16, and vLLM runs float32 there too)."""
    value = fmt(result.get("output_tokens_per_s"))
    return f"{value} ({result['dtype']})" if "dtype" in result else value


def main(folder: str, rounds: int) -> None:
    out = Path(folder)
    print("\n| round | workload | pagedllm default | pagedllm dequantized | vLLM "
          "| default / vLLM | dequantized / vLLM |\n|---|---|---|---|---|---|---|")
    for r in range(1, rounds + 1):
        for wl in ("batch64", "shared_prefix"):
            ours = [load(out / f"throughput_{wl}_{q}_{r}.json") or {} for q in ("auto", "none")]
            theirs = load(out / f"vllm_{wl}_{r}.json") or {}
            best = theirs.get("output_tokens_per_s")
            print(f"| {r} | {wl} output tok/s | {with_dtype(ours[0])} | {with_dtype(ours[1])} "
                  f"| {with_dtype(theirs)} | {ratio(ours[0].get('output_tokens_per_s'), best)} "
                  f"| {ratio(ours[1].get('output_tokens_per_s'), best)} |")
    print("\n| round | weights | pagedllm decode tok/s | llama.cpp decode tok/s | ratio "
          "| pagedllm first token ms | llama.cpp pp128 ms |\n|---|---|---|---|---|---|---|")
    for r in range(1, rounds + 1):
        for q, f in (("auto", "q4_1"), ("none", "f16"), ("f16file", "f16")):
            lat = load(out / f"latency_{q}_{r}.json") or {}
            # The dequantized run is bfloat16 or float32 (the CPU's default) against F16;
            # f16file runs llama.cpp's own F16 file (float32 activations over float16
            # weights on AVX2, bfloat16 on AVX512-BF16).
            dtype = lat.get("dtype", "dequantized")
            name = {"auto": "Q4_1", "none": f"{dtype} / F16",
                    "f16file": f"F16 file ({dtype}) / F16"}[q]
            decode, first = lat.get("decode_tokens_per_s"), lat.get("ttft_s")
            their_decode, their_first = llamacpp(out / f"llamacpp_{f}_{r}.json")
            print(f"| {r} | {name} | {fmt(decode, '.1f')} | {fmt(their_decode, '.1f')} "
                  f"| {ratio(decode, their_decode)} | {fmt(first and first * 1e3, '.1f')} "
                  f"| {fmt(their_first)} |")
    print(f"\nraw results: {out}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
