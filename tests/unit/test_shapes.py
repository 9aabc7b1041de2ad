"""The synthetic dataset and the colour/shape measures the default model is judged with."""

from __future__ import annotations

import random

import numpy as np
import pytest

from model_making.shapes import (
    COLOURS,
    SHAPES,
    ShapesDataset,
    ShapeSpec,
    dominant_colour,
    random_spec,
    render,
    shape_of,
)


def test_dataset_is_deterministic_by_seed_and_captions_name_what_is_drawn():
    first, second, other = ShapesDataset(200, seed=3), ShapesDataset(200, seed=3), ShapesDataset(200, seed=4)
    assert first.captions == second.captions and np.array_equal(first.pixels(), second.pixels())
    assert first.captions != other.captions
    assert 0.03 < first.captions.count("") / len(first) < 0.2, "about a tenth of captions are empty"
    for spec, caption in zip(first.specs, first.captions, strict=True):
        if caption:
            assert caption.startswith("a ") and caption.endswith(f"{spec.colour} {spec.shape}")
    assert {spec.colour for spec in first.specs} == set(COLOURS) and {spec.shape for spec in first.specs} == set(SHAPES)


def test_measures_read_every_drawn_shape_and_colour_back():
    rng = random.Random(0)
    for _ in range(300):
        spec = random_spec(rng)
        image = np.asarray(render(spec))
        assert (dominant_colour(image), shape_of(image)) == (spec.colour, spec.shape), spec


@pytest.mark.parametrize("colour", list(COLOURS))
def test_colour_survives_noise_and_blur(colour):
    image = np.asarray(render(ShapeSpec(colour, "circle", "medium", (32, 32)))).astype(float)
    noisy = np.clip(image + np.random.default_rng(0).normal(0, 25, image.shape), 0, 255).astype(np.uint8)
    assert dominant_colour(noisy) == colour


def test_blank_image_has_no_colour_or_shape():
    blank = np.full((64, 64, 3), 255, dtype=np.uint8)
    assert dominant_colour(blank) is None and shape_of(blank) is None
