"""Synthetic captioned shapes, and the measures that tell whether an image shows the one asked for.

The default model is trained on these images and judged with these measures, so both live here:
- ``render`` draws one shape (circle, square, triangle) in one colour (red, green, blue, yellow) on a
  plain white background; ``ShapesDataset`` draws many, deterministically from a seed, with captions
  such as ``a red circle`` or ``a small blue triangle``.
- ``dominant_colour`` and ``shape_of`` read a generated image back (see docs/default-model.md).
"""

from __future__ import annotations

import colorsys
import math
import random
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

SIZE = 64
BACKGROUND = (255, 255, 255)
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (30, 60, 220),
    "yellow": (240, 210, 20),
}
SHAPES = ("circle", "square", "triangle")
# Radius of the shape's circumscribed circle, in pixels of a 64x64 image.
SIZES: dict[str, int] = {"small": 11, "medium": 16, "large": 22}
# Hue (degrees) of each colour name; a pixel is read as the colour whose hue is closest.
HUES: dict[str, float] = {"red": 0.0, "yellow": 55.0, "green": 125.0, "blue": 230.0}


@dataclass(frozen=True)
class ShapeSpec:
    """One picture: what is drawn, how big, and where its centre is."""

    colour: str
    shape: str
    size: str
    centre: tuple[int, int]

    def caption(self, with_size: bool) -> str:
        words = [self.size] if with_size else []
        return " ".join(["a", *words, self.colour, self.shape])


def render(spec: ShapeSpec, size: int = SIZE) -> Image.Image:
    """Draw ``spec`` on a plain background (coordinates scale with ``size``)."""
    image = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    scale = size / SIZE
    cx, cy = spec.centre[0] * scale, spec.centre[1] * scale
    radius = SIZES[spec.size] * scale
    fill = COLOURS[spec.colour]
    if spec.shape == "circle":
        draw.ellipse((cx - radius, cy - radius, cx + radius, cy + radius), fill=fill)
    elif spec.shape == "square":
        half = radius / math.sqrt(2)
        draw.rectangle((cx - half, cy - half, cx + half, cy + half), fill=fill)
    else:  # an upright equilateral triangle inscribed in the circle
        points = [(cx + radius * math.sin(a), cy - radius * math.cos(a)) for a in (0, 2 * math.pi / 3, 4 * math.pi / 3)]
        draw.polygon(points, fill=fill)
    return image


def random_spec(rng: random.Random) -> ShapeSpec:
    """A shape of random colour, kind and size, placed wholly inside the image."""
    size = rng.choice(list(SIZES))
    margin = SIZES[size] + 2
    centre = (rng.randint(margin, SIZE - margin), rng.randint(margin, SIZE - margin))
    return ShapeSpec(rng.choice(list(COLOURS)), rng.choice(SHAPES), size, centre)


class ShapesDataset:
    """``count`` captioned pictures drawn from ``seed``; a fraction of captions left empty (for
    classifier-free guidance)."""

    def __init__(self, count: int, seed: int, empty_caption_fraction: float = 0.1):
        rng = random.Random(seed)
        self.specs = [random_spec(rng) for _ in range(count)]
        self.captions = [
            "" if rng.random() < empty_caption_fraction else spec.caption(with_size=rng.random() < 0.3)
            for spec in self.specs
        ]

    def __len__(self) -> int:
        return len(self.specs)

    def pixels(self) -> np.ndarray:
        """All images as uint8, shape (count, 64, 64, 3)."""
        return np.stack([np.asarray(render(spec)) for spec in self.specs])


def coloured_mask(image: np.ndarray) -> np.ndarray:
    """Pixels that belong to a shape: saturated and not dark (the background is white)."""
    rgb = image.astype(np.float32) / 255.0
    high, low = rgb.max(axis=-1), rgb.min(axis=-1)
    saturation = np.where(high > 0, (high - low) / np.maximum(high, 1e-6), 0.0)
    return (saturation > 0.4) & (high > 0.3)


def hue_name(rgb: tuple[float, float, float]) -> str:
    """The colour name whose hue is closest to the hue of ``rgb`` (components 0..1)."""
    hue = colorsys.rgb_to_hsv(*rgb)[0] * 360.0
    return min(HUES, key=lambda name: min(abs(hue - HUES[name]), 360.0 - abs(hue - HUES[name])))


def dominant_colour(image: np.ndarray) -> str | None:
    """The colour name most of the saturated pixels are closest to in hue; None without any."""
    mask = coloured_mask(image)
    if mask.sum() < 0.01 * mask.size:
        return None
    votes: dict[str, int] = {}
    for pixel in image[mask].astype(np.float32) / 255.0:
        name = hue_name(tuple(pixel))
        votes[name] = votes.get(name, 0) + 1
    return max(votes, key=votes.get)


def extent(mask: np.ndarray) -> float:
    """Area of ``mask`` over the area of its bounding box. The box spans the rows and columns holding
    at least two mask pixels, so that a few stray pixels do not stretch it."""
    rows = np.nonzero(mask.sum(axis=1) >= 2)[0]
    cols = np.nonzero(mask.sum(axis=0) >= 2)[0]
    if len(rows) == 0 or len(cols) == 0:
        return 0.0
    box = mask[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1]
    return float(box.sum() / box.size)


# A square fills its box, a circle pi/4 of it, an upright triangle half of it (0.55 to 0.60 once
# drawn in pixels).
SHAPE_EXTENTS: dict[str, float] = {"square": 1.0, "circle": math.pi / 4, "triangle": 0.57}


def shape_of(image: np.ndarray) -> str | None:
    """The shape whose box-filling ratio is closest to the coloured region's; None without one."""
    mask = coloured_mask(image)
    if mask.sum() < 0.01 * mask.size:
        return None
    ratio = extent(mask)
    return min(SHAPE_EXTENTS, key=lambda name: abs(SHAPE_EXTENTS[name] - ratio))


@dataclass(frozen=True)
class Judgement:
    """What was asked for and what the measures read in the image."""

    colour: str
    shape: str
    seed: int
    seen_colour: str | None
    seen_shape: str | None


def accuracy(judgements: list[Judgement]) -> dict[str, float]:
    """Share of images on colour, per colour and overall, and share of the right shape."""

    def share(items: list[Judgement], attribute: str) -> float:
        return sum(getattr(j, f"seen_{attribute}") == getattr(j, attribute) for j in items) / max(1, len(items))

    scores = {f"colour_{name}": share([j for j in judgements if j.colour == name], "colour") for name in COLOURS}
    scores["colour"] = share(judgements, "colour")
    scores["shape"] = share(judgements, "shape")
    return scores
