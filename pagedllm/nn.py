"""Module: the base of the inference layers, an nn.Module called straight through.

It lives below both attention/ (the Attention layer) and models/ (every other layer),
so that attention/ never imports models/ (DESIGN.md section 5).
"""

from __future__ import annotations

from typing import Any

from torch import nn


class Module(nn.Module):
    """nn.Module whose call is just `forward`.

    nn.Module.__call__ dispatches forward/backward hooks and checks global hook state on
    every call; inference layers register none, and at ~12 calls per decoder layer that
    dispatch was ~5% of a single-token decode step (SmolLM2-135M, bfloat16, 2 CPU threads).
    NOTE: hooks registered on these modules are therefore not run.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)
