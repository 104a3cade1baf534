"""vLLM's -O (--optimization-level) and --compilation-config (-cc), read into what they
mean here: whether decode steps are captured as CUDA graphs, and at which batch sizes.

vLLM's optimized path is its own torch.compile pipeline plus CUDA graphs; pagedllm's is
native kernels plus CUDA graphs of decode steps, with torch.compile opt-in (--compile).
So the settings that choose between eager and optimized map onto the graphs, and the
ones that tune vLLM's compiler passes are taken and have nothing to change here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pagedllm.errors import ConfigError

logger = logging.getLogger(__name__)

# vLLM's CompilationMode names (the values are their position).
COMPILATION_MODES = ("none", "stock_torch_compile", "dynamo_trace_once", "vllm_compile")
# vLLM's CUDAGraphMode names. Every one but "none" captures decode steps here (vLLM's
# FULL_DECODE_ONLY: prefill steps run eagerly).
CUDAGRAPH_MODES = ("none", "piecewise", "full", "full_decode_only", "full_and_piecewise")
# vLLM's keys that tune its compiler, its graph capture's internals or its encoder
# graphs: taken, with nothing to change here (logged).
NO_EFFECT_KEYS = frozenset((
    "backend", "cache_dir", "compile_cache_save_format", "compile_mm_encoder",
    "compile_ranges_endpoints", "compile_sizes", "cudagraph_copy_inputs",
    "cudagraph_decoder_replay", "cudagraph_mm_encoder", "cudagraph_num_of_warmups",
    "cudagraph_specialize_lora", "custom_ops", "debug_dump_path",
    "decoder_replay_cudagraph_capture_sizes", "decoder_replay_trim_threshold",
    "dynamic_shapes_config", "encoder_cudagraph_max_frames_per_batch",
    "encoder_cudagraph_max_vision_items_per_batch", "encoder_cudagraph_token_budgets",
    "fast_moe_cold_start", "inductor_compile_config", "inductor_passes",
    "ir_enable_torch_wrap", "pass_config", "splitting_ops", "use_inductor",
    "use_inductor_graph_partition"))
GRAPH_KEYS = frozenset(("mode", "level", "cudagraph_mode", "cudagraph_capture_sizes",
                        "max_cudagraph_capture_size"))


@dataclass(frozen=True)
class GraphSettings:
    """What -O and --compilation-config decide (DeviceConfig takes them)."""

    enforce_eager: bool
    # Batch sizes of the captured decode steps (None: vLLM's default list, 1, 2, 4, then
    # steps of 8, up to max_cuda_graph_size or max_num_seqs).
    cuda_graph_sizes: tuple[int, ...] | None = None
    max_cuda_graph_size: int | None = None


def resolve_graphs(enforce_eager: bool, compile: bool, optimization_level: int | None,
                   compilation_config: Any) -> GraphSettings:
    """The graph settings of --enforce-eager, -O and --compilation-config; ConfigError
    naming what is wrong or contradicts --compile."""
    eager = enforce_eager
    if optimization_level is not None:
        if isinstance(optimization_level, bool) or optimization_level not in (0, 1, 2, 3):
            raise ConfigError(f"optimization_level (-O) must be 0, 1, 2 or 3, got "
                              f"{optimization_level!r}")
        if optimization_level == 0:
            if compile:
                raise ConfigError("-O0 (no compilation, no CUDA graphs) and compile=True "
                                  "contradict each other: give one")
            eager = True
    cc = compilation_config
    if cc is None:
        return GraphSettings(eager)
    if isinstance(cc, int) and not isinstance(cc, bool):
        cc = {"mode": cc}  # vLLM's older `--compilation-config 3`: the level alone
    if not isinstance(cc, dict):
        raise ConfigError(f"compilation_config must be a JSON object, got {cc!r}")
    unknown = set(cc) - GRAPH_KEYS - NO_EFFECT_KEYS
    if unknown:
        raise ConfigError(f"unknown compilation_config keys {sorted(unknown)}; vLLM's "
                          f"are {sorted(GRAPH_KEYS | NO_EFFECT_KEYS)}")
    if "mode" in cc and "level" in cc:
        raise ConfigError("compilation_config: give mode or its old name level, not both")
    mode = _mode(cc.get("mode", cc.get("level")))
    if mode == 0 and compile:
        raise ConfigError("compilation_config mode 0 (none) and compile=True contradict "
                          "each other: give one")
    graph_mode = cc.get("cudagraph_mode")
    if graph_mode is not None:
        if not isinstance(graph_mode, str) or graph_mode.lower() not in CUDAGRAPH_MODES:
            raise ConfigError(f"compilation_config cudagraph_mode must be one of "
                              f"{[m.upper() for m in CUDAGRAPH_MODES]}, got {graph_mode!r}")
        eager = eager or graph_mode.lower() == "none"
    sizes = cc.get("cudagraph_capture_sizes")
    if sizes is not None:
        if (not isinstance(sizes, list)
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1
                           for s in sizes)):
            raise ConfigError(f"compilation_config cudagraph_capture_sizes must be a list of "
                              f"batch sizes >= 1, got {sizes!r}")
        sizes = tuple(sorted(set(sizes)))
    cap = cc.get("max_cudagraph_capture_size")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
        raise ConfigError(f"compilation_config max_cudagraph_capture_size must be an "
                          f"integer >= 0, got {cap!r}")
    if cap is not None and sizes is not None:
        sizes = tuple(s for s in sizes if s <= cap)
    if sizes == () or cap == 0:
        eager = True  # (vLLM: no sizes, no graphs)
    taken = sorted(set(cc) & NO_EFFECT_KEYS)
    if taken:
        logger.info("compilation_config: %s tune vLLM's compiler; no effect here",
                    ", ".join(taken))
    return GraphSettings(eager, sizes if not eager else None, cap if not eager else None)


def _mode(value: Any) -> int | None:
    """vLLM's compilation mode as its number (None: not given)."""
    if value is None:
        return None
    if isinstance(value, str) and value.lower() in COMPILATION_MODES:
        return COMPILATION_MODES.index(value.lower())
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 3:
        return value
    raise ConfigError(f"compilation_config mode must be 0-3 or one of "
                      f"{[m.upper() for m in COMPILATION_MODES]}, got {value!r}")
