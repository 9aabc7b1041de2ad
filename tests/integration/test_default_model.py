"""The default model listens, through the real server: colours, shapes, guidance, schedulers, and
batched requests that each get their own picture. Measures: ``model_making.shapes`` (docs/default-model.md)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from handler.families.sd import SCHEDULERS
from model_making.shapes import COLOURS, SHAPES, Judgement, accuracy, dominant_colour, shape_of
from tests.harness.images import decode_json_images, decode_png
from tests.harness.serving import run_behind_blocker

SEEDS = range(4)
ON_COLOUR = 0.9


def judge(client, colour: str, shape: str, seed: int, **fields) -> Judgement:
    response = client.predict({"prompt": f"a {colour} {shape}", "seed": seed, **fields})
    assert response.status_code == 200, response.text
    image = decode_png(response.content)
    return Judgement(colour, shape, seed, dominant_colour(image), shape_of(image))


def judge_all(client, **fields) -> list[Judgement]:
    """Every colour x shape prompt for every seed, four requests at a time (so they get batched)."""
    asked = [(colour, shape, seed) for colour in COLOURS for shape in SHAPES for seed in SEEDS]
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda item: judge(client, *item, **fields), asked))


@pytest.fixture(scope="module")
def default_judgements(client) -> list[Judgement]:
    return judge_all(client)


@pytest.mark.parametrize("colour", list(COLOURS))
def test_prompts_naming_a_colour_give_that_colour(default_judgements, colour):
    scores = accuracy(default_judgements)
    misses = [j for j in default_judgements if j.colour == colour and j.seen_colour != colour]
    assert scores[f"colour_{colour}"] >= ON_COLOUR, f"off colour: {misses}"


def test_shape_is_recognisable_for_most_prompts(default_judgements):
    scores = accuracy(default_judgements)
    misses = [(j.shape, j.seed, j.seen_shape) for j in default_judgements if j.seen_shape != j.shape]
    assert scores["shape"] >= 0.6, f"shape read back for {scores['shape']:.0%}; misses: {misses}"


def test_batched_mixed_colour_requests_each_get_their_own_colour(client):
    bodies = [
        {"prompt": f"a {colour} {shape}", "seed": 3, "response_format": "json"}
        for colour, shape in zip(COLOURS, ["circle", "square", "triangle", "circle"], strict=True)
    ]
    responses = run_behind_blocker(client, bodies)
    payloads = [response.json() for response in responses]
    assert all(payload["batch"]["max_step_images"] >= 2 for payload in payloads), (
        "the requests never shared a UNet forward"
    )
    seen = [dominant_colour(decode_json_images(payload)[0]) for payload in payloads]
    assert seen == list(COLOURS)


# PNDM's and LMS's fourth-order multistep extrapolation amplifies guidance 7.5 beyond what this small
# model holds: about half their images are off colour, in diffusers' own call too (docs/default-model.md;
# LMS Karras's sigmas hold). Strict: if one starts passing, the model card is out of date.
DIVERGES_AT_HIGH_GUIDANCE = {
    name: pytest.mark.xfail(strict=True, reason=f"{name} diverges at guidance 7.5 on the default model")
    for name in ("pndm", "lms")
}


@pytest.mark.parametrize(
    ("scheduler", "guidance_scale"),
    [
        pytest.param(
            name,
            guidance,
            marks=[DIVERGES_AT_HIGH_GUIDANCE[name]] if guidance == 7.5 and name in DIVERGES_AT_HIGH_GUIDANCE else [],
        )
        for name in SCHEDULERS
        for guidance in (1.0, 7.5)
    ],
)
def test_every_scheduler_and_guidance_stays_on_colour(client, scheduler, guidance_scale):
    asked = [(colour, seed) for colour in COLOURS for seed in range(3)]
    with ThreadPoolExecutor(len(asked)) as pool:  # all at once: they share forwards, as a batch would
        judgements = list(
            pool.map(
                lambda item: judge(
                    client, item[0], "circle", item[1], scheduler=scheduler, guidance_scale=guidance_scale
                ),
                asked,
            )
        )
    score = accuracy(judgements)["colour"]
    misses = [(j.colour, j.seed, j.seen_colour) for j in judgements if j.seen_colour != j.colour]
    assert score >= ON_COLOUR, f"{scheduler} at guidance {guidance_scale}: on colour {score:.0%}; misses {misses}"
