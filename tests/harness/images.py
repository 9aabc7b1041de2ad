"""Images as the tests send them and read them back, and the equality the tests allow across batch sizes."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image


def png_base64(image: Image.Image) -> str:
    """A picture as JSON requests carry it: base64 PNG."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_png(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def decode_json_images(payload: dict) -> list[np.ndarray]:
    return [decode_png(base64.b64decode(item)) for item in payload["images"]]


def assert_same_image(first: np.ndarray, second: np.ndarray) -> None:
    """Equal up to float rounding across batch sizes: at most 1 level on at most 1% of values."""
    difference = np.abs(first.astype(int) - second.astype(int))
    assert difference.max() <= 1, f"max difference {difference.max()}"
    assert (difference > 0).mean() <= 0.01, f"{(difference > 0).mean():.2%} of values differ"


# An adapter under test moves at least one channel value of its image by more than this: the
# positive control of a parity check, which a path that added nothing would pass on its own.
ADAPTER_EFFECT = 8


def assert_moved(image: np.ndarray, without: np.ndarray, what: str = "the LoRA") -> None:
    """``image`` differs from the same request's image ``without`` the adapter: the positive control."""
    difference = np.abs(np.asarray(image, dtype=np.int16) - np.asarray(without, dtype=np.int16)).max()
    assert difference > ADAPTER_EFFECT, f"{what} moved the image by {difference} levels at most"
