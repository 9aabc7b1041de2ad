"""A real TorchServe in continuous-batching mode with the default model: requests with different
step counts arrive staggered and each gets diffusers' own image (for every scheduler), a short
request overtakes a long one, and streamed progress ends with the image."""

from __future__ import annotations

import base64
import json
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests

from bench.reference import Reference
from handler.families.sd import SCHEDULERS
from tests.harness.images import decode_png
from tests.harness.serving import MODEL_DIR, Client, wait_until_denoising

LONG = {"prompt": "a red circle", "seed": 1, "num_inference_steps": 100}
SHORT = {"prompt": "a blue square", "seed": 2, "num_inference_steps": 4}
MEDIUM = {"prompt": "a green triangle", "seed": 3, "num_inference_steps": 10}


@pytest.fixture(scope="module")
def reference() -> Reference:
    return Reference(MODEL_DIR)


def assert_diffusers_image(reference: Reference, body: dict, image: np.ndarray) -> None:
    expected = reference(
        body["prompt"],
        body["seed"],
        64,
        64,
        body["num_inference_steps"],
        scheduler=body.get("scheduler", "ddim"),
        guidance_scale=body.get("guidance_scale", 7.5),
    )
    difference = np.abs(image.astype(np.int16) - np.asarray(expected.images[0], dtype=np.int16))
    assert difference.max() <= 1, f"{body}: differs from diffusers by {difference.max()}"


def timed(client: Client, body: dict) -> tuple[requests.Response, float]:
    response = client.predict(body)
    return response, time.monotonic()


def test_staggered_requests_get_diffusers_images_and_short_ones_overtake(continuous_client, reference):
    with ThreadPoolExecutor(3) as pool:
        long = pool.submit(timed, continuous_client, LONG)
        wait_until_denoising(continuous_client.server)  # the long request is denoising when the others arrive
        short = pool.submit(timed, continuous_client, SHORT)
        medium = pool.submit(timed, continuous_client, MEDIUM)
        results = {"long": long.result(), "short": short.result(), "medium": medium.result()}
    for name, (response, _) in results.items():
        assert response.status_code == 200, (name, response.text)
        assert response.headers["Content-Type"] == "image/png"
    assert results["short"][1] < results["long"][1], "the 4-step request waited for the 100-step one"
    for name, body in {"long": LONG, "short": SHORT, "medium": MEDIUM}.items():
        assert_diffusers_image(reference, body, decode_png(results[name][0].content))


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
def test_every_scheduler_gives_diffusers_image_while_requests_join(continuous_client, reference, scheduler):
    guidance = 1.0 if scheduler == "pndm" else 7.5  # pndm diverges at 7.5 on the default model
    body = {
        "prompt": "a yellow circle",
        "seed": 11,
        "num_inference_steps": 12,
        "scheduler": scheduler,
        "guidance_scale": guidance,
    }
    joining = {**body, "seed": 12, "num_inference_steps": 6}
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(continuous_client.image, **body)
        time.sleep(0.1)
        second = pool.submit(continuous_client.image, **joining)
        images = {"first": first.result(), "joining": second.result()}
    assert_diffusers_image(reference, body, images["first"])
    assert_diffusers_image(reference, joining, images["joining"])


def test_streamed_progress_parses_and_ends_with_the_image(continuous_client, reference):
    response = continuous_client.predict({**SHORT, "stream": True}, stream=True)
    assert response.status_code == 200 and response.headers["Content-Type"] == "application/x-ndjson"
    events = [json.loads(line) for line in response.iter_lines() if line]
    progress, done = events[:-1], events[-1]
    assert [event["step"] for event in progress] == [1, 2, 3]
    assert all(event["event"] == "progress" and event["total_steps"] == 4 for event in progress)
    assert done["event"] == "done" and done["seed"] == SHORT["seed"]
    assert_diffusers_image(reference, SHORT, decode_png(base64.b64decode(done["images"][0])))
