"""Image features of a step: each image encoded once, its rows put where its
placeholder tokens are computed.

A prompt's image runs the vision encoder the first step that computes any of its
placeholder positions (a chunked prefill may cover a run in several steps); the rows
are kept for the request until its prefill is past the run, then dropped. Each image
is encoded alone, so its rows, and the tokens after it, never depend on what else a
step holds. A preempted (or finished) request forgets its rows; recomputing it
encodes them again, to the same values.

A prompt given as embeddings (PromptEmbedsInput) takes the same path with rows that
need no encoder: they replace the token embeddings of every prompt position a step
computes.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pagedllm.core.contracts import NewRequestData
from pagedllm.mm_inputs import PromptEmbedsInput, PromptInput


class ImageEncoderCache:
    def __init__(self, model: nn.Module, device: torch.device) -> None:
        # The model's encode_image(pixels [3, H, W]) -> [tokens, hidden] (a model with
        # images) and embed_input_ids(ids [T]) -> [T, hidden].
        self.model, self.device = model, device
        self._images: dict[str, list[PromptInput]] = {}
        # req_id -> image index -> its rows, for runs the prefill has not passed yet.
        self._rows: dict[str, dict[int, torch.Tensor]] = {}

    def add_request(self, new: NewRequestData) -> None:
        if new.mm_inputs:
            self._images[new.req_id] = list(new.mm_inputs)
            self._rows[new.req_id] = {}

    def remove_request(self, req_id: str) -> None:
        self._images.pop(req_id, None)
        self._rows.pop(req_id, None)

    def any_scheduled(self, req_ids: list[str], num_computed: np.ndarray,
                      num_scheduled: np.ndarray) -> bool:
        """Whether the step computes any image placeholder (a captured graph embeds ids:
        such a step runs eagerly)."""
        return any(image.overlaps(int(c), int(c + n))
                   for req_id, c, n in zip(req_ids, num_computed, num_scheduled)
                   for image in self._images.get(req_id, ()))

    def inputs_embeds(self, input_ids: torch.Tensor, req_ids: list[str],
                      num_computed: np.ndarray, num_scheduled: np.ndarray,
                      query_start_loc: np.ndarray) -> torch.Tensor | None:
        """The step's input embeddings [T, hidden] with image rows in place, or None
        when no scheduled token is an image's (the model embeds the ids itself)."""
        spans = []  # (token index in the step, image rows, first row, count)
        for i, req_id in enumerate(req_ids):
            images = self._images.get(req_id)
            if not images:
                continue
            start = int(num_computed[i])
            end = start + int(num_scheduled[i])
            rows = self._rows[req_id]
            for k, image in enumerate(images):
                if not image.overlaps(start, end):
                    continue
                if k not in rows:
                    rows[k] = self._encode(image)
                lo, hi = max(start, image.offset), min(end, image.end)
                spans.append((int(query_start_loc[i]) + lo - start, rows[k],
                              lo - image.offset, hi - lo))
                if image.end <= end:  # the run is computed: its rows are not needed again
                    del rows[k]
        if not spans:
            return None
        embeds = self.model.embed_input_ids(input_ids)
        for at, rows, first, count in spans:
            embeds[at:at + count] = rows[first:first + count]
        return embeds

    def _encode(self, image: PromptInput) -> torch.Tensor:
        if isinstance(image, PromptEmbedsInput):
            # float32; put among the model's rows in its dtype.
            return torch.from_numpy(image.rows).to(self.device)
        pixels = torch.from_numpy(image.pixel_values).to(self.device)
        rows = self.model.encode_image(pixels)
        if rows.shape[0] != image.length:
            raise ValueError(f"an image encodes to {rows.shape[0]} rows, its placeholder "
                             f"run has {image.length}")
        return rows
