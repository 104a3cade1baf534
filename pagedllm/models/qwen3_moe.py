"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norms) with a
sparse mixture of experts in place of the MLP: the router's softmax over all experts,
the top k, renormalized over them when `norm_topk_prob` (the released models) and
weighting each expert's SiLU-gated MLP of `moe_intermediate_size`. No shared expert.
Layers listed in `mlp_only_layers`, or off the `decoder_sparse_step` stride, keep a
dense MLP of `intermediate_size` (none in the released models), as HF decides.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedllm.distributed.parallel_state import ParallelState
from pagedllm.models.llama import LlamaForCausalLM, LlamaMLP, LlamaVariant
from pagedllm.models.mixtral import MixtralMoE, expert_stacked_params
from pagedllm.models.utils import LLAMA_STACKED_PARAMS


def qwen3_moe_mlp(cfg: Any, parallel: ParallelState | None = None,
                  layer: int = 0) -> nn.Module:
    """The feed-forward block of `layer`: sparse or dense, by HF's rule."""
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    sparse = (layer not in (getattr(cfg, "mlp_only_layers", None) or [])
              and cfg.num_local_experts > 0 and (layer + 1) % step == 0)
    if not sparse:
        return LlamaMLP(cfg, parallel=parallel)
    return MixtralMoE(cfg, parallel, intermediate_size=cfg.moe_intermediate_size,
                      renormalize=bool(getattr(cfg, "norm_topk_prob", False)))


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    # Routing groups tokens by expert on the host (a sync each step): no CUDA graphs.
    supports_cuda_graphs = False

    def __init__(self, cfg: Any, attn_backend: str,
                 parallel: ParallelState | None = None) -> None:
        variant = LlamaVariant(qk_norm=True, make_mlp=qwen3_moe_mlp, stacked_params=(
            expert_stacked_params(cfg.num_local_experts, ("gate_proj", "up_proj",
                                                          "down_proj"))
            + LLAMA_STACKED_PARAMS))
        super().__init__(cfg, attn_backend, variant, parallel)
