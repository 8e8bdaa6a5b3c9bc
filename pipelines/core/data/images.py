"""The images of `image_chat` records: check, hash, measure and open the bytes a source gives.

    from pipelines.core import images
    images.check_image(data)          # -> (width, height); ImageError if Pillow cannot decode it
    images.open_image(data)           # -> a loaded PIL.Image (what a training stage feeds a model)
    images.count_placeholders(messages)   # the "<image>" tags of a chat: one per image, in order

An image is kept as the bytes of its file, never re-encoded: the stored bytes are what the source
held, so their SHA-256 (`sha256_hex`) names the image whatever its format, and two stages read the
same pixels. Pillow only (no torch): `ingest` and `prepare_data` import this module, and neither
needs more.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterable, Mapping
from typing import Any

from PIL import Image, UnidentifiedImageError

from pipelines.core.errors import QllmError

IMAGE_TOKEN = "<image>"
"""Where an image goes in a user turn (LLaMA-Factory's placeholder): a chat holds one per image,
the n-th tag standing for the n-th entry of `images`."""
FORMATS = ("PNG", "JPEG", "GIF", "BMP", "TIFF", "WEBP")
"""The image formats accepted: those image-text data sets hold. Not every format Pillow knows:
some (EPS) would run an external program to decode a file."""
_FORMATS_HELP = "PNG, JPEG, GIF, BMP, TIFF or WebP"


class ImageError(QllmError, ValueError):
    """Bytes that are not an image Pillow can decode (in `FORMATS`); the message says why, and the
    caller names the record and the image."""


def open_image(data: bytes) -> Image.Image:
    """The image stored as `data` (the bytes of an image file), decoded.

    Args:
        data: an image file's bytes, as `images` columns hold them.

    Returns:
        A loaded `PIL.Image.Image` (its pixels read, the buffer no longer needed), in the file's
        own mode: convert it (`.convert("RGB")`) as a model needs.

    Raises:
        ImageError: not an image in `FORMATS`, or a truncated or corrupt one.
    """
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:
        # (Pillow's own message names the in-memory buffer, an address that differs every run.)
        raise ImageError(f"not an image Pillow can read (expected {_FORMATS_HELP})") from None
    except Exception as exc:  # a broken header: Pillow's plugins raise OSError, SyntaxError, ValueError, ...
        raise ImageError(f"not a readable image ({type(exc).__name__}: {exc})") from None
    try:
        image.load()
    except Exception as exc:  # as above, while decoding: "image file is truncated", a bad chunk, ...
        raise ImageError(f"cannot decode the {image.format} image ({exc}); is the file complete?") from None
    return image


def check_image(data: bytes) -> tuple[int, int]:
    """Decode `data` whole (a truncated file fails only when its pixels are read) and return its
    `(width, height)`; `ImageError` says what is wrong otherwise."""
    with open_image(data) as image:
        return image.size


def image_size(data: bytes) -> tuple[int, int]:
    """The `(width, height)` of a stored image, from its header only: for bytes `check_image`
    accepted already (what `ingest` wrote), as `prepare_data` measures them. `ImageError` when the
    header is not an image's."""
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as image:
            return image.size
    except UnidentifiedImageError:
        raise ImageError(f"not an image Pillow can read (expected {_FORMATS_HELP})") from None
    except Exception as exc:  # as in open_image
        raise ImageError(f"not a readable image ({type(exc).__name__}: {exc})") from None


def sha256_hex(data: bytes) -> str:
    """The SHA-256 of an image's bytes, in hex: what deduplication compares (the same file is the
    same image; a re-encoded one is not)."""
    return hashlib.sha256(data).hexdigest()


def count_placeholders(messages: str | Iterable[Mapping[str, Any]]) -> int:
    """The number of `IMAGE_TOKEN`s in a chat's message contents, every role counted.

    Args:
        messages: a list of `{role, content}` messages, or its JSON text (a `messages` column).

    Returns:
        How many `<image>` tags the contents hold; a valid `image_chat` record holds one per
        image, all in user turns.
    """
    if isinstance(messages, str):
        messages = json.loads(messages)
    return sum(message["content"].count(IMAGE_TOKEN) for message in messages)
