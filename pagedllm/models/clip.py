"""CLIP's vision transformer: the image encoder of LLaVA.

pixels [3, H, W] -> patches (a stride-p convolution) behind a learned class token, plus
learned positions -> pre-LayerNorm -> pre-norm encoder layers (x += attn(LN1(x));
x += fc2(act(fc1(LN2(x))))) with full (bidirectional) attention over one image's
tokens. `forward` returns the hidden states LLaVA reads: index 0 is the embeddings
(after the pre-LayerNorm), index i the output of layer i, as transformers numbers them;
it runs only the layers up to the deepest one asked for.

Each image runs alone (a batch of one), so its features never depend on what else a
step encodes. Checkpoint names are HF's (`embeddings.*`, `pre_layrnorm.*`,
`encoder.layers.N.*`), with or without the `vision_model.` prefix.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.models.layers.activation import get_act_fn
from pagedllm.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedllm.models.layers.norm import LayerNorm
from pagedllm.nn import Module


class CLIPVisionEmbeddings(Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        hidden, patch = cfg.hidden_size, cfg.patch_size
        self.patch_size = patch
        self.class_embedding = nn.Parameter(torch.empty(hidden), requires_grad=False)
        self.patch_embedding = nn.Conv2d(cfg.num_channels, hidden, kernel_size=patch,
                                         stride=patch, bias=False)
        self.patch_embedding.weight.requires_grad_(False)
        self.num_positions = (cfg.image_size // patch) ** 2 + 1
        self.position_embedding = nn.Embedding(self.num_positions, hidden)
        self.position_embedding.weight.requires_grad_(False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[3, H, W] -> [1 + patches, hidden]."""
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype)[None])  # [1, D, h, w]
        patches = patches.flatten(2)[0].transpose(0, 1)  # [h * w, D]
        if patches.shape[0] + 1 != self.num_positions:
            raise ValueError(f"an image of {tuple(pixel_values.shape[1:])} pixels gives "
                             f"{patches.shape[0]} patches; the encoder has positions for "
                             f"{self.num_positions - 1}")
        x = torch.cat([self.class_embedding[None].to(patches.dtype), patches])
        return x + self.position_embedding.weight


class CLIPAttention(Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.q_proj = ColumnParallelLinear(hidden, hidden, bias=True)
        self.k_proj = ColumnParallelLinear(hidden, hidden, bias=True)
        self.v_proj = ColumnParallelLinear(hidden, hidden, bias=True)
        self.out_proj = RowParallelLinear(hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]

        def heads(t: torch.Tensor) -> torch.Tensor:  # [N, H*D] -> [H, N, D]
            return t.view(n, self.num_heads, self.head_dim).transpose(0, 1)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)),
                                             heads(self.v_proj(x)),
                                             scale=self.head_dim ** -0.5)
        return self.out_proj(out.transpose(0, 1).reshape(n, -1))


class CLIPEncoderLayer(Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.self_attn = CLIPAttention(cfg)
        self.layer_norm1 = LayerNorm(hidden, cfg.layer_norm_eps)
        self.layer_norm2 = LayerNorm(hidden, cfg.layer_norm_eps)
        self.mlp = CLIPMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPMLP(Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.act = get_act_fn(cfg.hidden_act)
        self.fc2 = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoder(Module):
    def __init__(self, cfg: Any, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(cfg) for _ in range(num_layers))


class CLIPVisionTransformer(Module):
    """`num_layers`: the encoder layers to build (LLaVA reads the second-to-last one's
    output: the last layer and the post-LayerNorm are never built, and their
    checkpoint weights are skipped)."""

    def __init__(self, cfg: Any, num_layers: int) -> None:
        super().__init__()
        self.embeddings = CLIPVisionEmbeddings(cfg)
        self.pre_layrnorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.encoder = CLIPEncoder(cfg, num_layers)

    def forward(self, pixel_values: torch.Tensor, layers: list[int]) -> list[torch.Tensor]:
        """The hidden states of `layers` (indices into transformers' hidden_states,
        each in [0, num_layers]) for one image [3, H, W]: each [1 + patches, hidden]."""
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        states = {0: x}
        for i, layer in enumerate(self.encoder.layers[:max(layers)], start=1):
            x = layer(x)
            states[i] = x
        return [states[i] for i in layers]

    _params: dict[str, nn.Parameter] | None = None

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        """Copy one checkpoint tensor (name relative to the vision tower); False for
        weights of parts not built (later layers, the post-LayerNorm)."""
        name = name.removeprefix("vision_model.")
        if self._params is None:
            self._params = dict(self.named_parameters())
        param = self._params.get(name)
        if param is None:
            parts = name.split(".")
            unbuilt_layer = (name.startswith("encoder.layers.")
                             and int(parts[2]) >= len(self.encoder.layers))
            if unbuilt_layer or name.startswith("post_layernorm.") \
                    or name == "embeddings.position_ids":
                return False
            raise KeyError(name)
        loader = getattr(param, "weight_loader", None)
        if loader is not None:
            loader(param, tensor)
        else:
            if param.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, "
                                 f"model {tuple(param.shape)}")
            param.data.copy_(tensor)
        return True
