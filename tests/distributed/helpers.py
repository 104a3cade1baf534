"""What the distributed-execution tests share: greedy runs of token-id prompts, their
outputs, logprob comparison, and finding an engine's worker processes."""

from __future__ import annotations

import psutil

from pagedllm import LLM, SamplingParams

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def assert_logprobs_close(ours, theirs, atol: float = 1e-4) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.keys() == b.keys()
        for token_id in a:
            assert abs(a[token_id].logprob - b[token_id].logprob) < atol


def worker_processes(root_pid: int | None = None) -> list[psutil.Process]:
    """The mp executor's worker processes below `root_pid` (default: this process)."""
    out = []
    for child in psutil.Process(root_pid).children(recursive=True):
        try:
            if any("pagedllm.executor.mp_worker" in arg for arg in child.cmdline()):
                out.append(child)
        except psutil.NoSuchProcess:
            continue
    return out
