"""Chat messages with images: OpenAI content parts -> what a multimodal chat template
reads, and the images in the order their placeholders appear.

Templates of multimodal models (llava-hf's and kin) read a message's content as a list
of parts, {"type": "text", "text": ...} and {"type": "image"}, and write the image token
for each image part; every message is given to them that way, string contents too.
"""

from __future__ import annotations

from typing import Any

from pagedllm.errors import InvalidRequestError
from pagedllm.multimodal.image import load_image_bytes, load_image_url
from pagedllm.multimodal.media_fetch import MediaPolicy, fetch_media

# Content part types that carry an image: OpenAI's image_url (a data URL here), and
# vLLM's offline image_pil (a PIL image); "image" with an "image" field as transformers'
# processors take it.
IMAGE_PART_TYPES = ("image_url", "image_pil", "image")


def has_images(messages: list[dict[str, Any]]) -> bool:
    return any(isinstance(m.get("content"), list)
               and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
                       for p in m["content"])
               for m in messages)


def template_parts(content: Any) -> tuple[list[dict[str, Any]], list[Any]]:
    """(the content as parts for a multimodal template, the images it holds: PIL images
    or data URL strings still to decode)."""
    if content is None:
        return [], []
    if isinstance(content, str):
        return [{"type": "text", "text": content}], []
    if not isinstance(content, list):
        raise InvalidRequestError(f"message content must be a string or a list of parts, "
                                  f"got {type(content).__name__}")
    parts: list[dict[str, Any]] = []
    images: list[Any] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": str(part.get("text", ""))})
            continue
        if kind not in IMAGE_PART_TYPES:
            raise InvalidRequestError(f"content part type {kind!r} is not supported (text, "
                                      f"image_url)")
        parts.append({"type": "image"})
        images.append(_image_of(part, kind))
    return parts, images


def _image_of(part: dict[str, Any], kind: str) -> Any:
    value = part.get(kind)
    if kind == "image_url":
        url = value.get("url") if isinstance(value, dict) else value
        if not isinstance(url, str):
            raise InvalidRequestError("an image_url part needs {'url': 'data:image/...'}")
        return url
    if value is None:
        raise InvalidRequestError(f"an {kind} part needs its {kind!r} field")
    return value


def split_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """(the messages with parts contents, every image in order)."""
    out, images = [], []
    for message in messages:
        parts, found = template_parts(message.get("content"))
        out.append({**message, "content": parts})
        images += found
    return out, images


def load_images(sources: list[Any], media: MediaPolicy | None = None) -> list[Any]:
    """Data URLs decoded (with the size limits of image.py); http(s):// and file://
    URLs fetched where `media` allows (media_fetch.py); PIL images as given."""
    return [s if not isinstance(s, str)
            else load_image_bytes(fetch_media(s, media))
            if media is not None and not s.startswith("data:")
            else load_image_url(s) for s in sources]
