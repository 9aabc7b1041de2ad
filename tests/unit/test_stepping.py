"""The step-level engine gives every request the image the request-level engine gives it, alone
and when it joins running requests mid-flight, for every scheduler (the trained default model)."""

from __future__ import annotations

import numpy as np
import pytest

from handler.batching import CallInputs, CallKey
from handler.config import HandlerSettings
from handler.pipeline import SCHEDULERS, load_text_to_image
from handler.stepping import StepEngine
from scripts.build_mar import DEFAULT_MODEL_DIR

# Batched and single UNet calls differ by float rounding only; after conversion to 8 bits an image
# may differ by this much per channel value (0-255).
TOLERANCE = 1


@pytest.fixture(scope="module")
def engine():
    return load_text_to_image(HandlerSettings(model_path=str(DEFAULT_MODEL_DIR)), "/unused")


def request(prompt: str, seeds: list[int]) -> CallInputs:
    return CallInputs([prompt] * len(seeds), [""] * len(seeds), seeds, [0] * len(seeds))


def assert_same_images(actual, expected) -> None:
    assert len(actual) == len(expected)
    for first, second in zip(actual, expected):
        difference = np.abs(np.asarray(first, dtype=np.int16) - np.asarray(second, dtype=np.int16))
        assert difference.max() <= TOLERANCE, f"images differ by up to {difference.max()}"


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
def test_a_request_stepped_alone_matches_the_request_level_engine(engine, scheduler):
    guidance = 1.0 if scheduler == "pndm" else 7.5  # pndm diverges at 7.5 on the small model (either engine)
    key = CallKey(64, 64, 6, scheduler, guidance)
    inputs = request("a blue square", [21, 22])
    expected, _ = engine.generate(key, inputs)
    stepper = StepEngine(engine)
    job = stepper.start(key, inputs)
    while not job.done:
        stepper.step([job])
    (images,) = stepper.finish([job])
    assert_same_images(images, expected)


def test_requests_joining_mid_flight_with_their_own_steps_scheduler_and_guidance_match(engine):
    stepper = StepEngine(engine)
    plan = [  # (joins before iteration, key, inputs)
        (0, CallKey(64, 64, 8, "ddim", 7.5), request("a red circle", [1])),
        (3, CallKey(64, 64, 5, "euler_a", 1.0), request("a green triangle", [2, 3])),
        (4, CallKey(64, 64, 4, "dpmpp_2m", 3.0), request("a yellow square", [4])),
    ]
    running, finished, iteration = {}, {}, 0
    while len(finished) < len(plan):
        for index, (joins, key, inputs) in enumerate(plan):
            if joins == iteration:
                running[index] = stepper.start(key, inputs)
        stepper.step(list(running.values()))
        for index in [index for index, job in running.items() if job.done]:
            (finished[index],) = stepper.finish([running.pop(index)])
        iteration += 1
    assert iteration == 8  # the first request's 8 steps; the others joined and left inside them
    for index, (_, key, inputs) in enumerate(plan):
        expected, _ = engine.generate(key, inputs)
        assert_same_images(finished[index], expected)


def test_one_forward_needs_one_latent_shape(engine):
    stepper = StepEngine(engine)
    small = stepper.start(CallKey(64, 64, 2, "ddim", 7.5), request("a", [0]))
    large = stepper.start(CallKey(128, 64, 2, "ddim", 7.5), request("b", [0]))
    with pytest.raises(ValueError, match="one latent shape"):
        stepper.step([small, large])
