"""StepProfiler: torch's profiler over a runner's steps, as ProfilerOptions say
(vLLM's --profiler-config): what it records, from which step after start_profile
(delay_iterations) and for how many (max_iterations), and how the trace is written
(Chrome trace JSON, gzipped or not, with a table of the ops' total times beside it)."""

from __future__ import annotations

from pathlib import Path

import torch

from pagedllm.config import ProfilerOptions


class StepProfiler:
    def __init__(self, options: ProfilerOptions, device_type: str) -> None:
        self.options = options
        names = options.activities or (("CPU", "CUDA") if device_type == "cuda" else ("CPU",))
        self._activities = [getattr(torch.profiler.ProfilerActivity, n) for n in names]
        self._profiler: torch.profiler.profile | None = None
        self._recording = False
        self._steps = -1  # steps since start(); -1: not started

    @property
    def started(self) -> bool:
        return self._steps >= 0

    def start(self) -> None:
        self._steps = 0
        if self.options.delay_iterations == 0:
            self._begin()

    def before_step(self) -> None:
        """At the start of each step: begin or end recording where the options say."""
        if not self.started:
            return
        opts = self.options
        if self._profiler is None and self._steps == opts.delay_iterations:
            self._begin()
        elif (self._recording and opts.max_iterations
              and self._steps == opts.delay_iterations + opts.max_iterations):
            self._profiler.stop()
            self._recording = False
        self._steps += 1

    def stop(self, stem: Path) -> str | None:
        """Stop; the trace's path (`stem` + .trace.json[.gz]), None when no step was
        recorded (delay_iterations not reached)."""
        profiler, self._profiler, self._steps = self._profiler, None, -1
        if profiler is None:
            return None
        if self._recording:
            profiler.stop()
            self._recording = False
        stem.parent.mkdir(parents=True, exist_ok=True)
        path = f"{stem}.trace.json" + (".gz" if self.options.use_gzip else "")
        profiler.export_chrome_trace(path)  # torch gzips a path ending in .gz
        if self.options.dump_time_total:
            table = profiler.key_averages().table(sort_by="self_cpu_time_total",
                                                  row_limit=100)
            Path(f"{stem}.txt").write_text(table + "\n")
        return path

    def _begin(self) -> None:
        opts = self.options
        self._profiler = torch.profiler.profile(
            activities=self._activities, record_shapes=opts.record_shapes,
            with_stack=opts.with_stack, profile_memory=opts.with_memory,
            with_flops=opts.with_flops)
        self._profiler.start()
        self._recording = True
