"""Shared builders for core tests, exposed as fixtures that return factory functions.

(Fixtures rather than an importable helper module: test directories have no
`__init__.py`, so a plain `utils.py` could clash with another directory's.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.contracts import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams


def _make_request(req_id: str, prompt: int | Sequence[int], *, max_tokens: int | None = 16,
                  eos_token_id: int | None = None, min_tokens: int = 0,
                  stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
                  priority: int = 0, arrival_time: float | None = None,
                  deadline: float | None = None) -> Request:
    """A request; `prompt` is the token ids, or a length (ids 0..n-1 then)."""
    prompt_token_ids = list(range(prompt)) if isinstance(prompt, int) else list(prompt)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=min_tokens,
                            stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos)
    return Request(req_id, prompt_token_ids, params, eos_token_id=eos_token_id,
                   arrival_time=arrival_time, priority=priority, deadline=deadline)


def _make_scheduler(num_blocks: int = 10, block_size: int = 4, max_num_seqs: int = 8,
                    max_num_batched_tokens: int = 64, max_model_len: int = 64,
                    enable_chunked_prefill: bool = True,
                    enable_prefix_caching: bool = True, policy: str = "fcfs",
                    clock: Callable[[], float] | None = None,
                    preemption_mode: str = "recompute",
                    num_swap_blocks: int = 0, pipeline_depth: int = 1,
                    attention_pairs_per_token: int = 0,
                    long_prefill_token_threshold: int = 0,
                    reserve_full_prompt: bool = True) -> Scheduler:
    sched_config = SchedulerConfig(max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   max_model_len=max_model_len,
                                   enable_chunked_prefill=enable_chunked_prefill,
                                   policy=policy, preemption_mode=preemption_mode,
                                   attention_pairs_per_token=attention_pairs_per_token,
                                   long_prefill_token_threshold=long_prefill_token_threshold,
                                   reserve_full_prompt=reserve_full_prompt)
    cache_config = CacheConfig(block_size=block_size, num_kv_blocks=num_blocks,
                               enable_prefix_caching=enable_prefix_caching)
    kw = {} if clock is None else {"clock": clock}
    return Scheduler(sched_config, cache_config, num_blocks, num_swap_blocks=num_swap_blocks,
                     pipeline_depth=pipeline_depth, **kw)


def _fake_runner_output(scheduler: Scheduler, output: SchedulerOutput,
                        next_token: Callable[[Request], int]) -> ModelRunnerOutput:
    """What a model runner would return: one token for each request whose prompt (and
    recomputed outputs) is now fully computed, [] for a partial prefill."""
    req_ids = [r.req_id for r in output.scheduled_new_reqs]
    req_ids += [r.req_id for r in output.scheduled_cached_reqs]
    sampled: list[list[int]] = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        done = request.num_computed_tokens >= request.num_tokens
        sampled.append([next_token(request)] if done else [])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def _step(scheduler: Scheduler, next_token: Callable[[Request], int] = lambda r: 0
          ) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step with a fake runner: schedule, 'run', update."""
    output = scheduler.schedule()
    runner_output = _fake_runner_output(scheduler, output, next_token)
    return output, scheduler.update_from_output(output, runner_output)


@pytest.fixture
def make_request() -> Callable[..., Request]:
    return _make_request


@pytest.fixture
def make_scheduler() -> Callable[..., Scheduler]:
    return _make_scheduler


@pytest.fixture
def step() -> Callable[..., tuple[SchedulerOutput, list[Request]]]:
    return _step
