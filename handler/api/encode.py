"""Encode generated images and errors into response bodies."""

from __future__ import annotations

import base64
import io
import json
from typing import Any

from PIL.Image import Exif, Image

CONTENT_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
JSON_CONTENT_TYPE = "application/json"
# Quality of lossy formats when a request sets no output_compression (0..100, higher is better).
DEFAULT_QUALITY = 90
# EXIF tag ImageDescription: where an encoded image says whether the safety checker flagged it.
EXIF_IMAGE_DESCRIPTION = 0x010E
NSFW_DESCRIPTION = "nsfw_content_detected={}"


def encode_image(
    image: Image, output_format: str, nsfw_content_detected: bool | None = None, quality: int | None = None
) -> bytes:
    """PNG (lossless), JPEG or WebP bytes of one image; ``quality`` (0..100) for JPEG and WebP,
    ``DEFAULT_QUALITY`` when None. Where a safety checker ran, the image's EXIF ImageDescription
    reads ``nsfw_content_detected=true`` (or ``false``)."""
    quality = DEFAULT_QUALITY if quality is None else quality
    buffer = io.BytesIO()
    exif = Exif()
    if nsfw_content_detected is not None:
        exif[EXIF_IMAGE_DESCRIPTION] = NSFW_DESCRIPTION.format(str(nsfw_content_detected).lower())
    if output_format == "png":
        image.save(buffer, format="PNG", exif=exif)
    elif output_format == "jpeg":
        image.convert("RGB").save(buffer, format="JPEG", quality=quality, exif=exif)
    elif output_format == "webp":
        image.save(buffer, format="WEBP", quality=quality, exif=exif)
    else:
        raise ValueError(f"unsupported output_format {output_format!r}; allowed: {', '.join(CONTENT_TYPES)}")
    return buffer.getvalue()


def json_body(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode("utf-8")


def images_json(encoded: list[bytes], metadata: dict[str, Any]) -> bytes:
    """The JSON response: base64 images plus seed, parameters and timings."""
    return json_body({"images": [base64.b64encode(data).decode("ascii") for data in encoded], **metadata})


def error_json(status: int, error: str, message: str, details: list[dict[str, str]] | None = None) -> bytes:
    """A JSON error body: the status, a short error kind, a sentence, and per-field details."""
    payload: dict[str, Any] = {"code": status, "type": error, "message": message}
    if details:
        payload["errors"] = details
    return json_body(payload)
