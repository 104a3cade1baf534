"""Images as a request carries them: preprocessed pixels and where their placeholder
tokens sit in the prompt; and prompt embeddings, which replace a whole prompt's.

A multimodal prompt holds one run of placeholder tokens (the model's image token) per
image, as long as the vision encoder's output for it; the runner puts the encoder's
rows in place of those tokens' embeddings. Everything here is plain data (numpy pixels,
ints, a hex digest), so it crosses to worker processes with the request.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from pagedllm.errors import InvalidRequestError


class _Run:
    """Positions [offset, offset + length) of a prompt whose embeddings are replaced."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        """Whether any of its positions is in [start, end)."""
        return self.offset < end and start < self.end


@dataclass(frozen=True)
class ImageInput(_Run):
    """One image of a prompt."""

    # The image processor's output: float32 numpy array [3, H, W].
    pixel_values: Any
    # sha256 of the pixels and their shape (hex): equal images give equal hashes in
    # every process, so the prefix cache shares their K/V and never mixes two images.
    hash: str
    # Index in the prompt of its first placeholder token, and the run's length (the
    # vision encoder's output rows for one image).
    offset: int
    length: int


@dataclass(frozen=True)
class PromptEmbedsInput(_Run):
    """A prompt given as input embeddings (vLLM's prompt_embeds) instead of tokens: its
    rows go in place of the token embeddings of the whole prompt, as an image's rows go
    in place of its placeholders (the prompt's token ids are placeholders, 0)."""

    # float32 numpy array [length, hidden_size].
    rows: Any
    # pixels_hash of the rows: equal prompts share their K/V in the prefix cache.
    hash: str
    offset: int
    length: int


# What may replace a prompt's token embeddings: an image's encoder rows, or given rows.
PromptInput = ImageInput | PromptEmbedsInput


@dataclass(frozen=True)
class ProcessedImage:
    """An image already through the model's image processor (float32 numpy [3, H, W]):
    what the server hands the engine after preprocessing off the event loop. Its shape
    is checked against the processor's output before the request is accepted."""

    pixel_values: Any


def pixels_hash(pixel_values: Any) -> str:
    """The hash an ImageInput (or PromptEmbedsInput) carries: its dtype, shape and
    bytes, hashed."""
    h = hashlib.sha256(f"{pixel_values.dtype}:{tuple(pixel_values.shape)}".encode())
    h.update(pixel_values.tobytes())
    return h.hexdigest()


def expand_image_tokens(token_ids: list[int], image_token_id: int, num_images: int,
                        tokens_per_image: int) -> tuple[list[int], list[int]]:
    """(ids with each image's placeholder run at its full length, each run's offset).

    A prompt names an image by one image token (as a chat template writes it) or by a
    run already expanded to `tokens_per_image` (the ids transformers' processor gives):
    a run of image tokens whose length is a multiple of `tokens_per_image` is that many
    expanded images, any other run one image per token. The images counted must be
    `num_images`.
    """
    out: list[int] = []
    offsets: list[int] = []
    i, n = 0, len(token_ids)
    while i < n:
        if token_ids[i] != image_token_id:
            out.append(token_ids[i])
            i += 1
            continue
        j = i
        while j < n and token_ids[j] == image_token_id:
            j += 1
        run = j - i
        count = run // tokens_per_image if run % tokens_per_image == 0 else run
        for _ in range(count):
            offsets.append(len(out))
            out.extend([image_token_id] * tokens_per_image)
        i = j
    if len(offsets) != num_images:
        raise InvalidRequestError(f"the prompt has {len(offsets)} image placeholder(s) "
                                  f"(token {image_token_id}) for {num_images} image(s): "
                                  f"give one placeholder per image")
    return out, offsets
