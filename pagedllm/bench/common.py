"""Shared pieces of the benchmarks: workloads, statistics, reporting."""

from __future__ import annotations

import argparse
import json
import math
import random
import resource
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm.errors import InvalidRequestError


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: greedy, exactly max_tokens new tokens (EOS ignored)."""

    prompt_token_ids: list[int]
    max_tokens: int


def add_workload_args(parser: argparse.ArgumentParser, lengths: bool = True,
                      seed: bool = False) -> None:
    """--dataset FILE.json, or random prompts (--random-input-len/--random-output-len).

    The random workload's seed is `--seed`: the engine's flag where engine flags are
    present, else added here (`seed=True`).
    """
    group = parser.add_argument_group("workload")
    group.add_argument("--dataset", default=None,
                       help="JSON list of {prompt_token_ids, max_tokens} objects")
    if lengths:
        group.add_argument("--random-input-len", type=int, default=128,
                           help="prompt tokens of each random request (without --dataset)")
        group.add_argument("--random-output-len", type=int, default=128,
                           help="output tokens of each random request (without --dataset)")
    group.add_argument("--num-prompts", type=int, default=None,
                       help="requests to run: random ones to generate, or the first N of "
                            "the dataset (default: all of it, or 64 random)")
    if seed:
        group.add_argument("--seed", type=int, default=0, help="seed of the random workload")


def add_engine_bench_args(parser: argparse.ArgumentParser) -> None:
    """Options of the benchmarks that start an engine in this process."""
    parser.add_argument("--skip-tokenizer-init", action="store_true",
                        help="run without a tokenizer (prompts are token ids; outputs are "
                             "not detokenized)")
    parser.add_argument("--lora-path", default=None,
                        help="a PEFT LoRA adapter directory every request runs with (turns "
                             "on --enable-lora)")


def lora_setup(ns: argparse.Namespace, engine_args: Any) -> tuple[Any, Any]:
    """(engine args, LoRARequest or None) for --lora-path."""
    if not ns.lora_path:
        return engine_args, None
    from dataclasses import replace

    from pagedllm.lora_request import LoRARequest

    return replace(engine_args, enable_lora=True), LoRARequest("bench", 1, ns.lora_path)


def load_dataset(path: str) -> list[BenchRequest]:
    """Read a workload file: a JSON list of {"prompt_token_ids": [...], "max_tokens": n}."""
    try:
        items = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InvalidRequestError(f"cannot read dataset {path!r}: {e}") from e
    if not isinstance(items, list) or not items:
        raise InvalidRequestError(f"dataset {path!r} must be a non-empty JSON list")
    requests = []
    for i, item in enumerate(items):
        try:
            ids, max_tokens = item["prompt_token_ids"], int(item["max_tokens"])
        except (TypeError, KeyError, ValueError) as e:
            raise InvalidRequestError(f"dataset {path!r} item {i}: needs prompt_token_ids "
                                      f"and max_tokens ({e})") from e
        if not ids or max_tokens < 1:
            raise InvalidRequestError(f"dataset {path!r} item {i}: empty prompt or "
                                      f"max_tokens < 1")
        requests.append(BenchRequest([int(t) for t in ids], max_tokens))
    return requests


def random_requests(num: int, input_len: int, output_len: int, vocab_size: int,
                    seed: int = 0) -> list[BenchRequest]:
    """`num` prompts of `input_len` uniform random token ids, each asking `output_len`."""
    if input_len < 1 or output_len < 1 or num < 1:
        raise InvalidRequestError("random workloads need input/output lengths and "
                                  "--num-prompts >= 1")
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(vocab_size) for _ in range(input_len)], output_len)
            for _ in range(num)]


def workload_from_args(ns: argparse.Namespace, vocab_size: int,
                       default_num: int = 64) -> list[BenchRequest]:
    if ns.dataset:
        requests = load_dataset(ns.dataset)
        return requests[:ns.num_prompts] if ns.num_prompts else requests
    return random_requests(ns.num_prompts or default_num, ns.random_input_len,
                           ns.random_output_len, vocab_size, ns.seed)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated q-th percentile (0..100) of `values` (nan if empty)."""
    if not values:
        return float("nan")
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def summarize(values: list[float], name: str, scale: float = 1.0) -> dict[str, float]:
    """{name: median, name_mean, name_p90, name_p99} of `values` times `scale`."""
    scaled = [v * scale for v in values]
    return {name: percentile(scaled, 50),
            f"{name}_mean": sum(scaled) / len(scaled) if scaled else float("nan"),
            f"{name}_p90": percentile(scaled, 90), f"{name}_p99": percentile(scaled, 99)}


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def result_of(backend: str, requests: list[BenchRequest], num_output: int,
              elapsed: float, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The throughput result of one backend (shared by bench/throughput.py and
    bench/hf_backend.py, so both report the same keys)."""
    num_prompt = sum(len(r.prompt_token_ids) for r in requests)
    return {
        "backend": backend,
        "num_requests": len(requests),
        "num_prompt_tokens": num_prompt,
        "num_output_tokens": num_output,
        "elapsed_s": elapsed,
        "requests_per_s": len(requests) / elapsed,
        "output_tokens_per_s": num_output / elapsed,
        "total_tokens_per_s": (num_prompt + num_output) / elapsed,
        "peak_rss_mb": peak_rss_mb(),
        **(extra or {}),
    }


async def fetch_model_name(client: Any, base_url: str) -> str | None:
    """The first model a server lists (bench serve --soak's httpx client), None when the
    server does not answer."""
    try:
        response = await client.get(f"{base_url}/v1/models")
        return response.json()["data"][0]["id"]
    except Exception:
        return None


def emit(result: dict[str, Any], title: str, lines: list[str]) -> None:
    """The result as JSON on stdout; a readable summary on stderr."""
    print(f"\n===== {title} =====", file=sys.stderr)
    for line in lines:
        print(line, file=sys.stderr)
    print(json.dumps(_finite(result), indent=2))
    sys.stdout.flush()


def _finite(value: Any) -> Any:
    """NaN / inf -> null, so stdout is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


# The offline engine's cumulative scheduler counters a benchmark reports the change of.
COUNTERS = ("num_preemptions", "num_swaps_out", "num_scheduled_tokens_total",
            "num_draft_tokens", "num_accepted_tokens")


def engine_counters(engine: Any) -> dict[str, int | None]:
    """COUNTERS of an offline LLMEngine now: its scheduler's, or with data parallel
    replicas their sums (which do not count scheduled tokens: None)."""
    scheduler = getattr(engine.engine_core, "scheduler", None)
    if scheduler is not None:
        return {name: getattr(scheduler, name) for name in COUNTERS}
    stats = engine.engine_core.get_stats()
    return {name: stats.get(name) for name in COUNTERS}


def counter_changes(after: dict[str, int | None], before: dict[str, int | None],
                    ) -> dict[str, int | None]:
    return {name: None if after[name] is None else after[name] - before[name]
            for name in after}


def spec_decode_stats(config: Any, changes: dict[str, int | None]) -> dict[str, Any]:
    """Speculative decoding counters (`changes` of engine_counters over the run); {}
    without speculative decoding."""
    if config.speculative is None:
        return {}
    drafts, accepted = changes["num_draft_tokens"], changes["num_accepted_tokens"]
    return {"speculative_method": config.speculative.method,
            "num_speculative_tokens": config.speculative.num_speculative_tokens,
            "num_draft_tokens": drafts, "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / drafts if drafts else None}


def spec_decode_line(r: dict[str, Any]) -> list[str]:
    """The summary line of spec_decode_stats' figures ([] without them)."""
    if "num_draft_tokens" not in r:
        return []
    rate = r["acceptance_rate"]
    return [f"speculative:          {r['speculative_method']} k={r['num_speculative_tokens']}"
            f", {r['num_accepted_tokens']}/{r['num_draft_tokens']} proposals accepted"
            f" ({'-' if rate is None else f'{rate:.1%}'})"]
