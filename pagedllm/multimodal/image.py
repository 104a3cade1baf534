"""Images from what users send: PIL images, or bytes / data URLs decoded with limits.

A hostile image is refused before it is decoded in full: its pixel count is read from
the header first (a small file can declare a huge canvas), and the server sends no
more than its body limit of encoded bytes.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from typing import Any

from pagedllm.errors import InvalidRequestError

# Most pixels an image may declare (width * height): 8192 x 4096 and a little more. Its
# decoded RGB copy is at most 3 bytes a pixel (~100 MiB at the limit).
MAX_IMAGE_PIXELS = 1 << 25


def load_image_url(url: str, max_pixels: int = MAX_IMAGE_PIXELS) -> Any:
    """The RGB PIL image of a `data:image/...;base64,` URL (OpenAI's image_url). Other
    URLs are refused: fetching them would let a request make the server reach any
    address."""
    if not isinstance(url, str) or not url.startswith("data:"):
        shown = url[:60] if isinstance(url, str) else type(url).__name__
        raise InvalidRequestError(f"image_url must be a data URL (data:image/png;base64,"
                                  f"...); this server fetches no remote images: got "
                                  f"{shown!r}")
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise InvalidRequestError("an image data URL must be base64: "
                                  "data:<mime type>;base64,<data>")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidRequestError(f"the image data URL is not valid base64: {e}") from e
    return load_image_bytes(data, max_pixels)


def load_image_bytes(data: bytes, max_pixels: int = MAX_IMAGE_PIXELS) -> Any:
    """The RGB PIL image of encoded bytes (PNG, JPEG, GIF's first frame, ...)."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            # PIL's own bomb check warns (or raises) on its global limit; ours is below.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            check_image_size(image, max_pixels)
            image.load()
            return image.convert("RGB")
    except InvalidRequestError:
        raise
    except Exception as e:  # noqa: BLE001 (PIL raises many kinds on bad data)
        raise InvalidRequestError(f"cannot decode the image: {e}") from e


def check_image_size(image: Any, max_pixels: int = MAX_IMAGE_PIXELS) -> None:
    width, height = image.size
    if width < 1 or height < 1:
        raise InvalidRequestError(f"the image is empty ({width} x {height} pixels)")
    if width * height > max_pixels:
        raise InvalidRequestError(f"the image has {width} x {height} pixels, more than "
                                  f"the {max_pixels} allowed")
