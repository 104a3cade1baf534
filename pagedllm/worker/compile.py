"""torch.compile integration: the model's forward as inductor graphs.

Attention stays an opaque custom op (`pagedllm::attention`, attention/forward_context.py)
that reads the step's metadata from the forward context, so the graphs depend only on
the number of scheduled tokens T: one graph specialized to T = 1 (single-request decode,
where per-op Python overhead dominates) and one with T dynamic for everything else.
Compiled artifacts are cached on disk (`cache_root()/inductor`), so only the first start
on a machine pays the full compilation.

Opt-in (`EngineArgs.compile`). On the CPUs measured so far the eager path wins: its
linear layers use oneDNN-packed weights and a native GEMV, attention and the element-wise
ops are native kernels, so little Python overhead is left for compilation to remove,
while compiling SmolLM2-135M's two graphs takes minutes on a 2-core machine (tens of
seconds with a warm cache) against a ~5 s eager start.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
from torch import nn

from pagedllm.attention.forward_context import ForwardContext, bind_forward_context
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.worker.memory import attention_layers

logger = logging.getLogger(__name__)


def configure_inductor_cache(cache_dir: Path) -> None:
    """Point inductor's on-disk caches (FX graphs, kernels) at `cache_dir`.

    NOTE: inductor reads its cache location from the environment only; this sets it for
    the process, before the first compilation.
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir))
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True


class CompiledForward:
    """`model(input_ids, positions, attn_metadata)` through compiled graphs."""

    def __init__(self, model: nn.Module, cache_dir: Path, freezing: bool = True) -> None:
        configure_inductor_cache(cache_dir)
        self.model = model
        self.context = ForwardContext(layers=attention_layers(model))
        # freezing: weights become constants, so inductor can pre-pack them for oneDNN.
        self._compiled = torch.compile(self._forward, fullgraph=True, dynamic=False,
                                       options={"freezing": freezing})
        self._seen: set[bool] = set()

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, None)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 attn_metadata: AttentionMetadata) -> torch.Tensor:
        is_single = input_ids.shape[0] == 1
        if not is_single:
            # One graph for every T >= 2 (T = 1 keeps its own, fully static graph).
            torch._dynamo.mark_dynamic(input_ids, 0)
            torch._dynamo.mark_dynamic(positions, 0)
        start = time.perf_counter() if is_single not in self._seen else None
        with bind_forward_context(self.context, attn_metadata):
            hidden = self._compiled(input_ids, positions)
        if start is not None:
            self._seen.add(is_single)
            logger.info("compiled the %s graph in %.1f s", "T=1" if is_single else "dynamic-T",
                        time.perf_counter() - start)
        return hidden
