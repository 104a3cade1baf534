"""LLaVA (`LlavaForConditionalGeneration`: llava-1.5, llava-interleave, bakLlava): a CLIP
vision encoder, a two-layer projector, and a decoder from this package.

An image's features are the CLIP hidden states of `vision_feature_layer` (one index or
several, concatenated), without the class token under the "default" strategy, through
linear_1 -> act -> linear_2 into the decoder's hidden size: one row per placeholder
token. The model runner (worker/mm_encoder.py) encodes each image alone
(`encode_image`), puts its rows in place of the placeholders' token embeddings
(`embed_input_ids`) and runs the decoder on those embeddings (`inputs_embeds`).

The engine reads the decoder's config: loader/hf_config.py flattens LLaVA's config into
its text config plus the vision fields (`vision_config`, `image_token_id`,
`vision_feature_layer`, ...; `text_architecture` names the decoder's class).

Checkpoints come in transformers' two layouts: `language_model.model.*` /
`language_model.lm_head.*` / `vision_tower.*` / `multi_modal_projector.*` (llava-hf on
the Hub), or `model.language_model.*` / `lm_head.*` / `model.vision_tower.*` /
`model.multi_modal_projector.*`.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.distributed.parallel_state import SINGLE_RANK, ParallelState
from pagedllm.errors import ModelLoadError
from pagedllm.models.clip import CLIPVisionTransformer
from pagedllm.models.layers.activation import get_act_fn
from pagedllm.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedllm.models.registry import get_model_class
from pagedllm.nn import Module


def feature_layers(cfg: Any) -> list[int]:
    """`vision_feature_layer` as indices into CLIP's hidden states (0: the embeddings,
    i: layer i's output)."""
    layers = cfg.vision_feature_layer
    layers = [layers] if isinstance(layers, int) else list(layers)
    num = cfg.vision_config.num_hidden_layers
    return [layer if layer >= 0 else num + 1 + layer for layer in layers]


class LlavaMultiModalProjector(Module):
    def __init__(self, cfg: Any, num_feature_layers: int) -> None:
        super().__init__()
        bias = getattr(cfg, "multimodal_projector_bias", True)
        vision, text = cfg.vision_config.hidden_size, cfg.hidden_size
        self.linear_1 = ColumnParallelLinear(vision * num_feature_layers, text, bias=bias)
        self.act = get_act_fn(cfg.projector_hidden_act)
        self.linear_2 = RowParallelLinear(text, text, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(Module):
    """forward / compute_logits as the decoder's, plus `inputs_embeds`; `encode_image`
    and `embed_input_ids` for the runner. Under tensor parallelism the decoder is
    sharded and the vision tower and projector are whole on every rank (each rank
    encodes the step's images: the same rows everywhere); under pipeline parallelism the
    first stage does."""

    is_multimodal = True
    # Pipeline parallelism: the decoder's stages; images are encoded on the first (every
    # stage builds the small vision tower and projector).
    supports_pp = True

    @staticmethod
    def layer_sliding_windows(cfg: Any) -> list[int | None]:
        windows = getattr(get_model_class(cfg.text_architecture), "layer_sliding_windows",
                          None)
        return windows(cfg) if windows is not None else [None] * cfg.num_hidden_layers

    def __init__(self, cfg: Any, attn_backend: str,
                 parallel: ParallelState | None = None,
                 language_model_only: bool = False) -> None:
        super().__init__()
        parallel = parallel or SINGLE_RANK
        text_cls = get_model_class(cfg.text_architecture)
        if "inputs_embeds" not in inspect.signature(text_cls.forward).parameters:
            raise ModelLoadError(f"LLaVA with a {cfg.text_architecture} decoder is not "
                                 f"supported (it takes no input embeddings)")
        kwargs = ({"parallel": parallel}
                  if parallel.tp_size > 1 or parallel.pp_size > 1 else {})
        self.language_model = text_cls(cfg, attn_backend, **kwargs)
        self.feature_layers = feature_layers(cfg)
        self.drop_class_token = cfg.vision_feature_select_strategy == "default"
        # --language-model-only: no encoder at all (its weights are skipped on load).
        self.vision_tower = self.multi_modal_projector = None
        if not language_model_only:
            self.vision_tower = CLIPVisionTransformer(cfg.vision_config,
                                                      max(self.feature_layers))
            self.multi_modal_projector = LlavaMultiModalProjector(cfg,
                                                                  len(self.feature_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata,
                hidden_states: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model(input_ids, positions, attn_metadata, hidden_states,
                                   inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.language_model.compute_logits(hidden)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden]: the decoder's token embeddings."""
        return self.language_model.model.embed_tokens(input_ids)

    def encode_image(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """One image [3, H, W] -> its placeholder rows [tokens, hidden]."""
        states = self.vision_tower(pixel_values, self.feature_layers)
        if self.drop_class_token:
            states = [s[1:] for s in states]
        return self.multi_modal_projector(torch.cat(states, dim=-1))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        vision_loaded: set[str] = set()

        def decoder_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith("model.language_model."):  # the second layout
                    yield "model." + name.removeprefix("model.language_model."), tensor
                    continue
                if name.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
                    name = name.removeprefix("model.")
                if self.vision_tower is None and name.startswith(
                        ("vision_tower.", "multi_modal_projector.")):
                    continue  # language model only
                if name.startswith("vision_tower."):
                    short = name.removeprefix("vision_tower.")
                    if self.vision_tower.load_weight(short, tensor):
                        vision_loaded.add(short.removeprefix("vision_model."))
                elif name.startswith("multi_modal_projector."):
                    self._load_projector(name.removeprefix("multi_modal_projector."), tensor)
                    vision_loaded.add(name)
                elif name.startswith("language_model."):
                    yield name.removeprefix("language_model."), tensor
                else:  # the second layout's lm_head.*
                    yield name, tensor

        loaded = self.language_model.load_weights(decoder_weights())
        if self.vision_tower is None:
            return loaded
        expected = {n for n, _ in self.vision_tower.named_parameters()}
        expected |= {f"multi_modal_projector.{n}"
                     for n, _ in self.multi_modal_projector.named_parameters()}
        missing = sorted(expected - vision_loaded)
        if missing:
            raise ModelLoadError(f"weights missing from the checkpoint: {missing[:5]}")
        return loaded | vision_loaded

    def _load_projector(self, name: str, tensor: torch.Tensor) -> None:
        param = dict(self.multi_modal_projector.named_parameters()).get(name)
        if param is None:
            raise ModelLoadError(f"unexpected weight multi_modal_projector.{name}")
        param.weight_loader(param, tensor)
