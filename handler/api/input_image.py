"""Input images of image-to-image and inpainting requests: bytes (a form's file part) or base64
text (JSON, optionally a ``data:`` URL) -> a checked PIL image.

Everything is refused by the field it came in, with the rule it broke: not base64, not a PNG,
JPEG or WebP image, more pixels than ``max_input_pixels`` (read from the header, before any pixel
is decoded, so a decompression bomb costs nothing), corrupt pixel data, a mode that is not 8-bit,
a mask without transparency or of another size than the image.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError
from pydantic_core import PydanticCustomError

FORMATS = ("PNG", "JPEG", "WEBP")
# 8-bit modes (grey, palette, colour, with or without alpha): anything else is refused.
MODES = frozenset({"1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr"})
DATA_URL_PREFIX = "data:"


def _raw(value: Any) -> bytes:
    """The encoded image: file bytes as sent, or base64 text (also in a form's text part) decoded."""
    if isinstance(value, (bytes, bytearray)):  # a file part, or base64 in a text part (image files are not ASCII)
        try:
            return _raw(bytes(value).decode("ascii")) if value.isascii() and value else bytes(value)
        except PydanticCustomError:
            return bytes(value)
    if not isinstance(value, str):
        raise PydanticCustomError(
            "image_type",
            "an image is base64 text in JSON (or a file part in a form), got {kind}",
            {"kind": type(value).__name__},
        )
    text = value.split(",", 1)[1] if value.startswith(DATA_URL_PREFIX) and "," in value else value
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise PydanticCustomError("base64", "an image in JSON must be base64 text (or a data: URL)") from None


def _webp_size(raw: bytes) -> tuple[int, int] | None:
    """A WebP's canvas size from its first chunk (Pillow's WebP opener allocates the canvas, so
    the size is checked before it runs); None for anything else."""
    if len(raw) < 30 or raw[:4] != b"RIFF" or raw[8:12] != b"WEBP":
        return None
    chunk = raw[12:16]
    if chunk == b"VP8X":
        return 1 + int.from_bytes(raw[24:27], "little"), 1 + int.from_bytes(raw[27:30], "little")
    if chunk == b"VP8L":
        bits = int.from_bytes(raw[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8 ":
        return int.from_bytes(raw[26:28], "little") & 0x3FFF, int.from_bytes(raw[28:30], "little") & 0x3FFF
    return None


def _open(value: Any, max_pixels: int) -> Image.Image:
    """The image opened from its header only (no pixel decoded), within ``max_pixels``."""
    raw = _raw(value)
    size = _webp_size(raw)
    if size is not None and size[0] * size[1] > max_pixels:
        raise _too_large(size, max_pixels)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw), formats=FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):  # PIL's own, far above any limit here
        raise _too_large(None, max_pixels) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise PydanticCustomError("image_format", "not a PNG, JPEG or WebP image") from None
    if image.width * image.height > max_pixels:
        raise _too_large(image.size, max_pixels)
    return image


def _too_large(size: tuple[int, int] | None, max_pixels: int) -> PydanticCustomError:
    claimed = "claims more pixels than the decoder allows" if size is None else "is {width}x{height} = {pixels} pixels"
    width, height = size or (0, 0)
    return PydanticCustomError(
        "image_too_large",
        f"the image {claimed}, more than the configured max_input_pixels {{limit}}",
        {"width": width, "height": height, "pixels": width * height, "limit": max_pixels},
    )


def peek_size(value: Any, max_pixels: int) -> tuple[int, int] | None:
    """An image's width and height from its header; None where it cannot be read (validation says why)."""
    try:
        return _open(value, max_pixels).size
    except PydanticCustomError:
        return None


def read_image(value: Any, max_pixels: int) -> Image.Image:
    """A checked, decoded input image (mode and alpha as sent)."""
    image = _open(value, max_pixels)
    if image.mode not in MODES:
        raise PydanticCustomError(
            "image_mode",
            "image mode {mode} is not served: send an 8-bit colour, greyscale or palette image",
            {"mode": image.mode},
        )
    try:
        image.load()
    except (OSError, ValueError, SyntaxError):
        raise PydanticCustomError("image_corrupt", "the image data is corrupt or truncated") from None
    return image


def as_rgb(image: Image.Image) -> Image.Image:
    """The picture the pipeline starts from: RGB (transparency dropped)."""
    return image if image.mode == "RGB" else image.convert("RGB")


def as_mask(image: Image.Image) -> Image.Image:
    """An OpenAI-style mask (transparent where the image is repainted) as diffusers' mask: grey,
    white where repainted (the inpaint pipelines repaint where it is at least half white: alpha
    below 128). Raises where the mask has no transparency (an alpha channel or a tRNS key)."""
    if "A" not in image.getbands() and "transparency" not in image.info:
        raise PydanticCustomError(
            "mask_alpha",
            "the mask needs an alpha channel: its fully transparent pixels mark where the image is repainted "
            "(got mode {mode})",
            {"mode": image.mode},
        )
    return ImageOps.invert(image.convert("RGBA").getchannel("A"))


def canny(image: Image.Image, low_threshold: int, high_threshold: int) -> Image.Image:
    """A photo as an edge map, as diffusers' ControlNet examples make one: OpenCV's Canny on the RGB
    pixels, white edges on black, in three channels."""
    import cv2  # imported where used: only a request asking for it needs OpenCV

    edges = cv2.Canny(np.asarray(image), low_threshold, high_threshold)
    return Image.fromarray(np.repeat(edges[:, :, None], 3, axis=2))


def fit(width: int, height: int, min_side: int, max_side: int, max_pixels: int, multiple: int = 8) -> tuple[int, int]:
    """An input image's size as the output size: scaled down (aspect kept) to fit ``max_side`` and
    ``max_pixels``, then each side down to a multiple of ``multiple`` and at least ``min_side``
    (rounded up to a multiple)."""
    scale = min(1.0, max_side / max(width, height), (max_pixels / (width * height)) ** 0.5)
    smallest = -(-min_side // multiple) * multiple
    return tuple(  # type: ignore[return-value]  # two sides
        max(smallest, int(side * scale) // multiple * multiple) for side in (width, height)
    )
