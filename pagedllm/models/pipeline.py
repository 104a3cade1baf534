"""Pipeline-parallel stage layout: which layers (and ends of the model) a stage holds.

A stage builds only its contiguous range of decoder layers; the others are
`MissingLayer` placeholders (no weights, no KV cache), so layer indices, parameter names
and checkpoint names stay those of the whole model and the loader simply skips the
weights of parts this stage does not hold. The first stage embeds the tokens; the last
applies the final norm and the LM head (and keeps the embedding too when the head is tied
to it, as the tied weight is stored only under the embedding's name).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from pagedllm.distributed.parallel_state import ParallelState
from pagedllm.models.layers.embedding import LMHead
from pagedllm.nn import Module


class MissingLayer(Module):
    """A part of the model that lives on another pipeline stage."""

    def forward(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("called a layer that belongs to another pipeline stage")


def layer_range(num_layers: int, parallel: ParallelState) -> tuple[int, int]:
    """[start, end) of this stage's layers: equal shares, the remainder one each to the
    first stages (the last one also runs the LM head and the sampler)."""
    share, extra = divmod(num_layers, parallel.pp_size)
    rank = parallel.pp_rank
    start = rank * share + min(rank, extra)
    return start, start + share + (rank < extra)


def make_layers(num_layers: int, make_layer: Callable[[int], nn.Module],
                parallel: ParallelState) -> tuple[int, int, nn.ModuleList]:
    """(start, end, layers): make_layer(i) for this stage's i, MissingLayer elsewhere."""
    start, end = layer_range(num_layers, parallel)
    layers = nn.ModuleList(make_layer(i) if start <= i < end else MissingLayer()
                           for i in range(num_layers))
    return start, end, layers


def stage_part(holds: bool, make: Callable[[], nn.Module]) -> nn.Module:
    """make() when this stage holds the part, else a placeholder."""
    return make() if holds else MissingLayer()


def missing_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Parameter-name prefixes of the parts held by other stages ("model.layers.7.")."""
    return tuple(f"{name}." for name, module in model.named_modules()
                 if isinstance(module, MissingLayer))


def stage_lm_head(vocab_size: int, hidden_size: int, parallel: ParallelState,
                  tied_to: nn.Module | None = None) -> nn.Module:
    """The LM head on the last stage (sharing `tied_to`'s weight when given: the tied
    embedding the last stage keeps for it), a placeholder on the others."""
    if not parallel.is_last_stage:
        return MissingLayer()
    head = LMHead(vocab_size, hidden_size, parallel=parallel)
    if tied_to is not None:
        head.tie(tied_to)
    return head
