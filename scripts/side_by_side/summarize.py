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


def main(folder: str, rounds: int) -> None:
    out = Path(folder)
    print("\n| round | workload | pagedllm default | pagedllm bf16 | vLLM bf16 | default / vLLM"
          " | bf16 / vLLM |\n|---|---|---|---|---|---|---|")
    for r in range(1, rounds + 1):
        for wl in ("batch64", "shared_prefix"):
            ours = [(load(out / f"throughput_{wl}_{q}_{r}.json") or {}).get("output_tokens_per_s")
                    for q in ("auto", "none")]
            theirs = (load(out / f"vllm_{wl}_{r}.json") or {}).get("output_tokens_per_s")
            print(f"| {r} | {wl} output tok/s | {fmt(ours[0])} | {fmt(ours[1])} | {fmt(theirs)} "
                  f"| {ratio(ours[0], theirs)} | {ratio(ours[1], theirs)} |")
    print("\n| round | weights | pagedllm decode tok/s | llama.cpp decode tok/s | ratio "
          "| pagedllm first token ms | llama.cpp pp128 ms |\n|---|---|---|---|---|---|---|")
    for r in range(1, rounds + 1):
        for q, f, name in (("auto", "q4_1", "Q4_1"), ("none", "f16", "bf16 / F16")):
            lat = load(out / f"latency_{q}_{r}.json") or {}
            decode, first = lat.get("decode_tokens_per_s"), lat.get("ttft_s")
            their_decode, their_first = llamacpp(out / f"llamacpp_{f}_{r}.json")
            print(f"| {r} | {name} | {fmt(decode, '.1f')} | {fmt(their_decode, '.1f')} "
                  f"| {ratio(decode, their_decode)} | {fmt(first and first * 1e3, '.1f')} "
                  f"| {fmt(their_first)} |")
    print(f"\nraw results: {out}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
