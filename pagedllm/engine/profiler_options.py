"""vLLM's --profiler-config: which profiler, where its traces go and what they hold.

The torch profiler is built (traces of the model's steps on every worker, as with
--profiler-dir); vLLM's CUDA (Nsight capture range) and Triton Proton profilers are
refused by name, as are the options of features not built here (profiling CUDA graph
capture, roofline annotations). vLLM's schedule options (wait, warmup and active
iterations) record the same steps here through delay_iterations / max_iterations: the
warm-up steps run unrecorded instead of recorded and dropped. The front end is never
profiled, which is what vLLM's ignore_frontend asks for.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pagedllm.config import ProfilerOptions, require_json_object
from pagedllm.errors import ConfigError

_BOOLS = {"torch_profiler_with_stack": "with_stack", "torch_profiler_with_flops": "with_flops",
          "torch_profiler_use_gzip": "use_gzip",
          "torch_profiler_dump_cuda_time_total": "dump_time_total",
          "torch_profiler_record_shapes": "record_shapes",
          "torch_profiler_with_memory": "with_memory"}
_COUNTS = ("delay_iterations", "max_iterations", "warmup_iterations", "active_iterations",
           "wait_iterations")
_NOT_BUILT = {"capture_torch_profiler": "profiling CUDA graph capture",
              "detailed_trace_annotation": "roofline annotations in the trace"}
_ACTIVITIES = ("CPU", "CUDA")


def profiler_options(values: dict[str, Any] | None, profiler_dir: str | None,
                     ) -> tuple[str | None, ProfilerOptions]:
    """(the traces' directory, the options) of --profiler-config's JSON object beside
    --profiler-dir; vLLM's defaults where the object leaves a field unset."""
    if values is None:
        return profiler_dir, ProfilerOptions()
    require_json_object("profiler_config", values)
    values = dict(values)
    kind = values.pop("profiler", None)
    if kind not in (None, "torch"):
        raise ConfigError(f"profiler_config profiler {kind!r} is not built (the torch "
                          f"profiler is: 'torch')")
    proton = sorted(k for k in values if k.startswith("proton_"))
    if proton:
        raise ConfigError(f"profiler_config {proton[0]}: the Proton profiler is not built")
    for key, what in _NOT_BUILT.items():
        if values.pop(key, False):
            raise ConfigError(f"profiler_config {key}: {what} is not built")
    values.pop("ignore_frontend", None)  # the front end is never profiled here
    directory = values.pop("torch_profiler_dir", "") or None
    if directory is not None and kind != "torch":
        raise ConfigError("profiler_config torch_profiler_dir is only applicable when "
                          "profiler is 'torch'")
    if kind == "torch" and directory is None:
        raise ConfigError("profiler_config torch_profiler_dir must be set when profiler "
                          "is 'torch'")
    if directory is not None and profiler_dir is not None and directory != profiler_dir:
        raise ConfigError(f"profiler_config torch_profiler_dir {directory!r} and "
                          f"profiler_dir {profiler_dir!r} disagree")
    # vLLM's defaults: stacks, gzip and the time table on, shapes off.
    options = ProfilerOptions(with_stack=True, record_shapes=False, use_gzip=True,
                              dump_time_total=True)
    for key, name in _BOOLS.items():
        value = values.pop(key, None)
        if value is not None:
            if not isinstance(value, bool):
                raise ConfigError(f"profiler_config {key} must be a bool, got {value!r}")
            setattr(options, name, value)
    counts = {}
    for key in _COUNTS:
        value = values.pop(key, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            raise ConfigError(f"profiler_config {key} must be an integer >= 0, got "
                              f"{value!r}")
        counts[key] = value
    activities = values.pop("torch_profiler_activities", None)
    if activities is not None:
        if (not isinstance(activities, list) or not activities
                or any(a not in _ACTIVITIES for a in activities)
                or len(set(activities)) != len(activities)):
            raise ConfigError(f"profiler_config torch_profiler_activities must list "
                              f"distinct values of {_ACTIVITIES}, got {activities!r}")
        options.activities = tuple(activities)
    if values:
        raise ConfigError(f"profiler_config: unknown key {sorted(values)[0]!r}")
    options = dataclasses.replace(options, **_iterations(counts))
    return directory or profiler_dir, options


def _iterations(counts: dict[str, int | None]) -> dict[str, int]:
    """delay_iterations / max_iterations, or the same window from vLLM's schedule
    (wait, warmup, then active iterations; active 5 by default once warmup is set)."""
    schedule = counts["warmup_iterations"] or counts["wait_iterations"]
    if not schedule:
        return {"delay_iterations": counts["delay_iterations"] or 0,
                "max_iterations": counts["max_iterations"] or 0}
    if counts["delay_iterations"] or counts["max_iterations"]:
        raise ConfigError("profiler_config: give delay_iterations / max_iterations or the "
                          "wait / warmup / active iterations, not both")
    active = counts["active_iterations"]
    if active == 0:
        raise ConfigError("profiler_config active_iterations must be >= 1")
    return {"delay_iterations": (counts["wait_iterations"] or 0)
            + (counts["warmup_iterations"] or 0),
            "max_iterations": 5 if active is None else active}
