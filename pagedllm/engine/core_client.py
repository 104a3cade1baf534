"""EngineCoreClient: the front end's handle on the engine-core process.

It offers EngineCore's request interface (add_request, abort_requests, stop_requests,
step, has_unfinished_requests), so an `LLMEngine` — tokenizer, input and output
processing, stop strings — runs unchanged on top of it in the API process, while the
schedule/execute loop runs in a spawned process (`core_proc.py`).

The front end keeps a mirror `Request` per live request: the one its InputProcessor
built. Output batches from the core are queued by `push_outputs` and applied to the
mirrors by the next `step()`, which never blocks. Receiving is asyncio (`get_output`).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import shutil
import tempfile
import time
from collections.abc import Iterable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from pagedllm.config import EngineConfig
from pagedllm.engine.core_proc import (GROWING_ATTRS, USER_ERRORS, AddRequest, CoreInput,
                                       CoreOutput, EngineCoreOutputs, EngineDead, EngineReady,
                                       FinishRequests, SchedulerStats, Shutdown, UtilityCall,
                                       run_engine_core_when_configured)
from pagedllm.errors import EngineDeadError
from pagedllm.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class EngineProcess:
    """The engine-core process, spawned before its config is known: it imports torch,
    transformers and the model runner (~2.5 s) while the front end reads the model's
    config (as long again), and waits for `configure`. `cancel` ends it if the config
    never comes."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        reader, self._writer = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=run_engine_core_when_configured, name="pagedllm-engine-core",
            daemon=True, args=(reader, os.getpid(),
                               logging.getLogger("pagedllm").getEffectiveLevel()))
        self.proc.start()
        reader.close()

    def configure(self, config: EngineConfig, input_addr: str, output_addr: str) -> None:
        try:
            self._writer.send((config, input_addr, output_addr))
        except OSError:  # it died in its imports: waiting for it reports the exit code
            pass
        finally:
            self._writer.close()

    def cancel(self) -> None:
        """End the process unless it was configured (then its client stops it). It
        holds nothing yet, so it is not waited for: a refused option fails at once."""
        if not self._writer.closed:
            self._writer.close()  # once past its imports it would read EOF and exit
            self.proc.terminate()
            self.proc.join(5.0)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()


class EngineCoreClient:
    """Spawns the engine-core process (or takes one spawned earlier: EngineProcess) and
    talks to it over two ipc sockets."""

    def __init__(self, config: EngineConfig, process: EngineProcess | None = None,
                 ) -> None:
        self._tmpdir = tempfile.mkdtemp(prefix="pagedllm-")
        input_addr = f"ipc://{self._tmpdir}/input"
        output_addr = f"ipc://{self._tmpdir}/output"
        # Sends are synchronous and never block (NOBLOCK, unbounded queue); receiving
        # is asyncio, so the two sockets live in two contexts.
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(input_addr)
        self._actx = zmq.asyncio.Context()
        self._output = self._actx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(output_addr)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreOutput)

        process = process or EngineProcess()
        process.configure(config, input_addr, output_addr)
        self.proc = process.proc
        self.engine_index = config.parallel.data_parallel_rank
        self.num_blocks = 0
        self.block_size = config.cache.block_size
        self.engine_pid: int | None = None
        self.dead_reason: str | None = None
        # Mirrors of the live requests, by req_id.
        self.requests: dict[str, Request] = {}
        # Output batches received and not yet applied by step().
        self._pending: list[EngineCoreOutputs] = []
        # Requests finished here (abort, stop string) since the front end last took them
        # (for metrics); their status says why.
        self.finished_locally: list[Request] = []
        # Live requests the core has not scheduled yet (its first output, possibly
        # empty, says it has): the queue that --max-queued-requests bounds.
        self._unscheduled: set[str] = set()
        self._call_ids = 0
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    async def wait_ready(self, timeout_s: float = 1800.0) -> None:
        """Wait for the core's start-up (model load, KV cache) or raise EngineDeadError."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = await self._recv(timeout_s=0.5)
            if isinstance(msg, EngineReady):
                self.num_blocks, self.engine_pid = msg.num_blocks, msg.pid
                logger.info("engine core ready (pid %d) after %.1f s", msg.pid,
                            time.monotonic() - deadline + timeout_s)
                return
            if isinstance(msg, EngineDead):
                if msg.user_error is not None:
                    # The model or the options: raised as such (the CLI prints one line).
                    self.dead_reason = msg.message
                    raise {e.__name__: e for e in USER_ERRORS}[msg.user_error](msg.message)
                self.mark_dead(msg.message)
                raise EngineDeadError(msg.message)
        self.mark_dead(f"engine core did not start within {timeout_s:.0f} s")
        raise EngineDeadError(self.dead_reason)

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    def check_alive(self) -> bool:
        """Whether the core process runs (a dead one is marked dead here)."""
        if not self.is_dead and not self.proc.is_alive():
            self.mark_dead(f"engine core process died (exit code {self.proc.exitcode})")
        return not self.is_dead

    def kill(self) -> None:
        """End the core process now (a shutdown past its grace period)."""
        self.proc.kill()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the core process (politely, then by signal) and close the sockets."""
        if self._closed:
            return
        self._closed = True
        if self.dead_reason is None:
            self.dead_reason = "the engine was shut down"
        if self.proc.is_alive():
            try:
                self._input.send(self._encoder.encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.proc.join(timeout_s)
        for stop in (self.proc.terminate, self.proc.kill):
            if self.proc.is_alive():
                stop()
                self.proc.join(2.0)
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._ctx.term()
        self._actx.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    # ------------------------------------------------------------------ EngineCore interface

    @property
    def num_unscheduled(self) -> int:
        return len(self._unscheduled)

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt tokens of the live requests that have no token yet (waiting, or in
        their prefill)."""
        return sum(r.num_prompt_tokens for r in self.requests.values()
                   if r.num_output_tokens == 0)

    def add_request(self, request: Request, sibling_of: str | None = None) -> None:
        self._send(AddRequest(request=pickle.dumps(request)))
        self.requests[request.req_id] = request
        self._unscheduled.add(request.req_id)

    def abort_requests(self, req_ids: Iterable[str]) -> list[Request]:
        return self._finish(req_ids, RequestStatus.FINISHED_ABORTED)

    def stop_requests(self, req_ids: Iterable[str]) -> list[Request]:
        """Finish requests as "stop" (a stop string was found in their text)."""
        return self._finish(req_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[Request]:
        """Apply the received output batches to the mirrors; return the updated ones."""
        updated: dict[str, Request] = {}
        for batch in self._pending:
            for out in batch.outputs:
                self._unscheduled.discard(out.req_id)
                req = self.requests.get(out.req_id)
                if req is None:
                    continue  # finished here meanwhile (abort, stop string)
                req.append_output_token_ids(out.new_token_ids)
                req.status = RequestStatus(out.status)
                req.stop_reason = out.stop_reason
                req.num_cached_tokens = out.num_cached_tokens
                if out.first_scheduled_time is not None:
                    req.first_scheduled_time = out.first_scheduled_time
                if out.extras is not None:
                    for attr, values in pickle.loads(out.extras).items():
                        if attr in GROWING_ATTRS or attr == "output_logprobs":
                            getattr(req, attr).extend(values)
                if req.is_finished:
                    del self.requests[out.req_id]
                elif not out.new_token_ids:
                    continue  # only "scheduled" (or prompt logprobs so far): nothing to emit
                updated[out.req_id] = req
        self._pending.clear()
        return list(updated.values())

    # ------------------------------------------------------------------ transport

    def push_outputs(self, batch: EngineCoreOutputs) -> None:
        """Queue a received batch for the next step()."""
        self._pending.append(batch)

    async def get_output(self, timeout_s: float) -> EngineCoreOutputs | None:
        """The next output batch, or None after timeout_s; EngineDeadError when the
        process is gone (checked on every timeout, so death is seen within timeout_s)."""
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        msg = await self._recv(timeout_s)
        if isinstance(msg, EngineDead):
            self.mark_dead(msg.message)
            raise EngineDeadError(msg.message)
        return msg if isinstance(msg, EngineCoreOutputs) else None

    @property
    def output_socket(self) -> zmq.asyncio.Socket:
        """The socket the core's messages arrive on (the data parallel client polls
        every replica's at once)."""
        return self._output

    def decode(self, frame: Any) -> CoreOutput:
        return self._decoder.decode(frame)

    async def _recv(self, timeout_s: float) -> CoreOutput | None:
        if await self._output.poll(timeout=int(timeout_s * 1000), flags=zmq.POLLIN):
            return self.decode(await self._output.recv(copy=False))
        if not self.check_alive():
            raise EngineDeadError(self.dead_reason)
        return None

    def call_utility(self, method: str, *args: Any) -> list[tuple[int, int]]:
        """Send a utility call; its result comes back in an output batch under the key
        (engine_index, call_id) returned (a list: the data parallel client's has one
        key per replica)."""
        self._call_ids += 1
        self._send(UtilityCall(call_id=self._call_ids, method=method, args=list(args)))
        return [(self.engine_index, self._call_ids)]

    @staticmethod
    def combine_utility(method: str, results: list[Any]) -> Any:
        """The result of a utility call from its replicas' results (here: the one)."""
        return results[0]

    def scheduler_stats(self, batch: EngineCoreOutputs) -> SchedulerStats:
        """The engine's scheduler state as of `batch` (the data parallel client sums the
        replicas' latest)."""
        return batch.scheduler_stats

    def take_finished_locally(self) -> list[Request]:
        """Requests finished in this process (abort, stop string) since the last call."""
        taken, self.finished_locally = self.finished_locally, []
        return taken

    def _finish(self, req_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        done = []
        for req_id in ([req_ids] if isinstance(req_ids, str) else req_ids):
            self._unscheduled.discard(req_id)
            req = self.requests.pop(req_id, None)
            if req is not None:
                req.status = status
                done.append(req)
        if done:
            self.finished_locally.extend(done)
            if not self.is_dead:
                self._send(FinishRequests([r.req_id for r in done], status.value))
        return done

    def _send(self, msg: CoreInput) -> None:
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        try:
            # With no connected peer (the core died) a PUSH send would block: NOBLOCK.
            self._input.send(self._encoder.encode(msg), zmq.NOBLOCK)
        except zmq.Again as e:
            self.mark_dead("engine core is not reading its input socket")
            raise EngineDeadError(self.dead_reason) from e

    def mark_dead(self, reason: str) -> None:
        """Record why the core is gone (the first reason wins); sends fail from now on."""
        if self.dead_reason is None:
            self.dead_reason = reason
            logger.error("engine core is dead: %s", reason)

