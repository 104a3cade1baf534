"""The engine core's side of structured output: grammars compiled off the loop, one
matcher per request, the token bitmask of each step.

A grammar can take seconds to compile (sample/structured_output.py), so a request that
has one waits here, outside the scheduler, while one background thread has it compiled
(in the compiler process of sample/grammar_process.py, or with compile limits off in this
process: xgrammar releases the GIL); the engine keeps stepping everything else meanwhile,
and hands the request to the scheduler once its matcher exists. A compile that fails or
runs over a limit finishes its request as aborted, with `Request.error` saying why.
Compiles wait their turn smallest constraint first (compile_queue.py). The matcher then
lives on the request (`Request.structured_output`), so it survives preemption as the
tokens do. For each step, `fill_bitmask` writes the allowed tokens of the requests that
sample in it into the SchedulerOutput (the runner applies them to the logits), and
`accept_tokens` advances the matchers with the tokens that come back. With a reasoning
parser (pagedllm/reasoning.py) a request's grammar starts after its reasoning: the
request's `ReasoningGate` reads its tokens, and while it reasons no mask is sent for it.

A thinking budget (SamplingParams.thinking_token_budget) rides on the same path: the
request's gate counts its reasoning tokens (`track` registers one without a grammar), and
once they reach the budget inside the reasoning, the request's row allows only the
forced end's next token (the end tag, or reasoning_end_str's tokens one by one): the
reasoning closes, greedy or sampled, and the answer follows.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from pagedllm.core.contracts import ModelRunnerOutput, SchedulerOutput
from pagedllm.engine.compile_queue import SmallestFirstExecutor
from pagedllm.errors import ModelLoadError
from pagedllm.reasoning import Phase
from pagedllm.request import Request
from pagedllm.sample.grammar_process import COMPILE_NICE, GrammarCompileError
from pagedllm.sample.structured_output import GrammarManager, allow_token, fill_bitmask

logger = logging.getLogger(__name__)


class StructuredOutputManager:
    def __init__(self, grammar: GrammarManager) -> None:
        self.grammar = grammar
        # One thread: compiles run one at a time, so a burst of big grammars holds one
        # core, not the engine's.
        self._pool = SmallestFirstExecutor("grammar-compile", initializer=_lower_priority)
        # Requests whose grammar is compiling, in arrival order.
        self._pending: dict[str, tuple[Request, Future]] = {}
        # Requests with a matcher or a thinking budget, until they finish (pruned by
        # fill_bitmask): a step with none skips the per-request loops below.
        self._live: dict[str, Request] = {}

    def warm_up(self) -> None:
        """Prepare the grammar compiler in the background (the compile thread), so the
        first grammar request does not wait for it; compiles queue behind it."""
        self._pool.submit(-1, self._warm_up)

    def _warm_up(self) -> None:
        try:
            self.grammar.warm_up()
        except ModelLoadError as e:  # no tokenizer (token-id models): nothing to prepare
            logger.warning("structured outputs will not compile: %s", e)
        except Exception:  # the first compile will try again, and fail its request
            if not self.grammar.closed:  # else: stopped by shutdown(), nothing went wrong
                logger.exception("preparing the grammar compiler failed")

    def submit(self, request: Request) -> None:
        """Start compiling the request's grammar; it waits here until `pop_ready`."""
        params = request.sampling_params.structured_outputs
        assert params is not None
        key = params.cache_key()  # once: the queue orders by it, the cache keys by it
        self._pending[request.req_id] = (request, self._pool.submit(
            constraint_size(key), self.grammar.compile, params, key))

    def track(self, request: Request) -> None:
        """Mask the steps of a request with a thinking budget and no grammar (it goes to
        the scheduler as it is)."""
        assert request.reasoning_gate is not None
        self._live[request.req_id] = request

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._pending

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def pop_ready(self) -> tuple[list[Request], list[Request]]:
        """(requests whose grammar compiled, now with their matcher; requests whose
        compile failed), each in arrival order, both no longer pending."""
        ready, failed = [], []
        for req_id, (request, future) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[req_id]
            try:
                compiled = future.result()
            except GrammarCompileError as e:
                # The constraint parsed when the request was validated; a compile can
                # still fail or run over the compile limits.
                logger.warning("request %s: its grammar did not compile: %s", req_id, e)
                request.error = f"structured_outputs: {e}"
                failed.append(request)
                continue
            except Exception as e:
                logger.exception("request %s: its grammar did not compile", req_id)
                request.error = f"structured_outputs: the grammar did not compile ({e!r})"
                failed.append(request)
                continue
            request.structured_output = self.grammar.new_matcher(compiled,
                                                                 request.eos_token_id)
            self._live[req_id] = request
            ready.append(request)
        return ready, failed

    def pop(self, req_ids: list[str]) -> list[Request]:
        """Take these requests out while they compile (aborted); unknown ids ignored.
        A compile already running finishes in the background, into the cache."""
        popped = []
        for req_id in req_ids:
            entry = self._pending.pop(req_id, None)
            if entry is not None:
                entry[1].cancel()
                popped.append(entry[0])
        return popped

    def pending_requests(self) -> list[Request]:
        return [request for request, _ in self._pending.values()]

    def wait(self, timeout: float) -> None:
        """Block until a pending compile ends or `timeout` seconds pass."""
        if self._pending:
            wait([future for _, future in self._pending.values()], timeout,
                 return_when=FIRST_COMPLETED)

    def fill_bitmask(self, so: SchedulerOutput) -> None:
        """The allowed tokens of the step's requests that sample under a grammar (their
        scheduled tokens reach the end of their sequence) into `so`."""
        if not self._live:
            return
        self._live = {req_id: r for req_id, r in self._live.items() if not r.is_finished}
        # A request still reasoning samples freely (no row), its grammar waiting for the
        # answer, unless its budget is spent: then its row allows the end tag alone. One
        # whose output may yet open a reasoning may also take the start tag.
        sampling = [request for req_id, request in self._live.items()
                    if req_id in so.num_scheduled_tokens
                    and request.num_computed_tokens >= request.num_tokens]
        ending = [r for r in sampling if r.reasoning_gate is not None
                  and r.reasoning_gate.forced_token() is not None]
        constrained = [r for r in sampling if r.structured_output is not None
                       and _phase(r) is not Phase.REASONING]
        sampling = constrained + ending
        if not sampling:
            return
        bitmask = self.grammar.allocate_bitmask(len(sampling))
        fill_bitmask([request.structured_output for request in constrained], bitmask)
        for row, request in enumerate(constrained):
            if _phase(request) is Phase.OPENING:
                allow_token(bitmask, row, request.reasoning_gate.start_id)
        for row, request in enumerate(ending, len(constrained)):
            bitmask[row].zero_()
            allow_token(bitmask, row, request.reasoning_gate.forced_token())
        so.grammar_bitmask = bitmask.numpy()
        so.structured_output_rows = {request.req_id: i for i, request in enumerate(sampling)}

    def accept_tokens(self, output: ModelRunnerOutput) -> None:
        """Advance the matchers of the step's requests with the tokens they sampled."""
        if not self._live:
            return
        for req_id, token_ids in zip(output.req_ids, output.sampled_token_ids):
            request = self._live.get(req_id)
            if not token_ids or request is None or request.is_finished:
                continue
            matcher: Any = request.structured_output  # (None: a budget alone)
            gate = request.reasoning_gate
            for token_id in token_ids:
                if gate is not None and not gate.accept(token_id):
                    continue  # reasoning, or its tags: not the grammar's
                if matcher is None:
                    continue
                if not matcher.is_terminated() and not matcher.accept_token(token_id):
                    logger.warning("request %s: grammar rejected sampled token %d",
                                   req_id, token_id)

    def shutdown(self) -> None:
        self._pool.shutdown()
        self.grammar.shutdown()


def _phase(request: Request) -> Phase:
    """Where the request's output stands for its grammar (the answer without a
    reasoning parser)."""
    gate = request.reasoning_gate
    return gate.phase if gate is not None else Phase.CONTENT


def constraint_size(key: tuple) -> int:
    """Characters in a constraint (its StructuredOutputsParams.cache_key()): what its
    compile is queued by."""
    value = key[1]
    if isinstance(value, str):
        return len(value)
    if isinstance(value, tuple):  # choices
        return sum(len(choice) for choice in value)
    return 0  # json_object


def _lower_priority() -> None:
    """Nice the compile thread (and the threads xgrammar starts from it, which inherit
    it; with compile limits the compiles run in a process niced alike and this thread
    only deserializes their results): on a CPU the engine's OpenMP threads wait for each
    other at every parallel region, so a compile competing with them as an equal slows
    every step many times over, while a niced one mostly runs in their gaps."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: run at normal priority
        pass
