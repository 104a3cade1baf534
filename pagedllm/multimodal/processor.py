"""A multimodal model's images -> the pixels and placeholder runs its requests carry.

The pixels come from the model's own transformers image processor (its
`preprocessor_config.json`: resize, crop, rescale, normalize), on the PIL backend, so
they are the ones transformers' processor gives. Each image takes one run of the
model's image token in the prompt, as long as the vision encoder's output.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedllm.errors import InvalidRequestError, ModelLoadError
from pagedllm.mm_inputs import ImageInput, ProcessedImage, expand_image_tokens, pixels_hash
from pagedllm.multimodal.image import check_image_size

# Images one prompt may hold unless the engine says otherwise (vLLM's
# limit_mm_per_prompt): each costs an encoder pass and its placeholder tokens.
DEFAULT_IMAGES_PER_PROMPT = 4


def tokens_per_image(hf_config: Any) -> int:
    """Placeholder tokens of one image: its patches, plus the class token unless the
    "default" feature strategy drops it (LLaVA)."""
    vision = hf_config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    return patches + (0 if hf_config.vision_feature_select_strategy == "default" else 1)


class ImageProcessor:
    def __init__(self, model_path: str, hf_config: Any,
                 max_images: int = DEFAULT_IMAGES_PER_PROMPT,
                 trust_remote_code: bool = False,
                 overrides: dict[str, Any] | None = None) -> None:
        """`overrides`: fields of the processor's config set over the file's (vLLM's
        mm_processor_kwargs), each one the processor must have."""
        from transformers import AutoImageProcessor

        try:
            self.hf = AutoImageProcessor.from_pretrained(model_path, backend="pil",
                                                         trust_remote_code=trust_remote_code)
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"cannot load the image processor of {model_path!r} "
                                 f"(preprocessor_config.json): {e}") from e
        for key, value in (overrides or {}).items():
            if key.startswith("_") or not hasattr(self.hf, key) or callable(
                    getattr(self.hf, key)):
                raise ModelLoadError(f"mm_processor_kwargs: the image processor "
                                     f"{type(self.hf).__name__} has no setting {key!r}")
            setattr(self.hf, key, value)
        self.image_token_id = hf_config.image_token_id
        self.tokens_per_image = tokens_per_image(hf_config)
        self.max_images = max_images
        # What every image becomes (the processor resizes and crops to one size); the
        # vision tower takes only its own size, so a mismatch is the model's, refused
        # here rather than failing the worker at the first image.
        probe = self.hf(images=[np.zeros((8, 8, 3), np.uint8)], return_tensors="np")
        self.pixel_shape = tuple(probe["pixel_values"].shape[1:])
        size = hf_config.vision_config.image_size
        if self.pixel_shape[1:] != (size, size):
            raise ModelLoadError(f"the image processor of {model_path!r} makes images of "
                                 f"{self.pixel_shape[1:]} pixels, its vision tower takes "
                                 f"{size} x {size}")

    def pixels(self, images: list[Any]) -> list[np.ndarray]:
        """Each image (PIL image, numpy [H, W, 3] uint8 array, or ProcessedImage) as
        the model's input: float32 [3, H, W]."""
        from PIL import Image

        out: list[np.ndarray | None] = []
        todo = []  # (index in out, image) for the processor
        for image in images:
            if isinstance(image, ProcessedImage):
                out.append(self._checked(image.pixel_values))
                continue
            if isinstance(image, Image.Image):
                check_image_size(image)
            elif not (isinstance(image, np.ndarray) and image.ndim == 3
                      and image.shape[-1] == 3 and image.dtype == np.uint8):
                raise InvalidRequestError(f"an image must be a PIL image or a numpy "
                                          f"[height, width, 3] uint8 array, got "
                                          f"{type(image).__name__}")
            todo.append((len(out), image))
            out.append(None)
        if todo:
            done = self.hf(images=[image for _, image in todo],
                           return_tensors="np")["pixel_values"]
            for (at, _), pixels in zip(todo, done):
                out[at] = np.ascontiguousarray(pixels, dtype=np.float32)
        return out  # type: ignore[return-value]

    def preprocess(self, images: list[Any]) -> list[ProcessedImage]:
        """`pixels` wrapped for the engine (the server runs this off the event loop)."""
        return [ProcessedImage(p) for p in self.pixels(images)]

    def _checked(self, pixels: Any) -> np.ndarray:
        if not (isinstance(pixels, np.ndarray) and pixels.dtype == np.float32
                and pixels.shape == self.pixel_shape and np.isfinite(pixels).all()):
            raise InvalidRequestError(f"preprocessed pixels must be a finite float32 "
                                      f"array of shape {self.pixel_shape}")
        return np.ascontiguousarray(pixels)

    def check_count(self, num_images: int) -> None:
        """InvalidRequestError past the image limit of one prompt."""
        if num_images > self.max_images:
            raise InvalidRequestError(f"{num_images} images in one prompt; at most "
                                      f"{self.max_images} are allowed "
                                      f"(limit_mm_per_prompt, --limit-mm-per-prompt)")

    def expand(self, token_ids: list[int], num_images: int) -> tuple[list[int], list[int]]:
        """(the prompt with each image's placeholder run at full length, each run's
        offset); InvalidRequestError when its placeholders are not `num_images`."""
        return expand_image_tokens(token_ids, self.image_token_id, num_images,
                                   self.tokens_per_image)

    def image_inputs(self, token_ids: list[int], images: list[Any],
                     ) -> tuple[list[int], list[ImageInput]]:
        """(the prompt with each image's placeholder run at full length, its images)."""
        self.check_count(len(images))
        ids, offsets = self.expand(token_ids, len(images))
        if not images:
            return ids, []
        inputs = [ImageInput(pixel_values=p, hash=pixels_hash(p), offset=offset,
                             length=self.tokens_per_image)
                  for p, offset in zip(self.pixels(images), offsets)]
        return ids, inputs
