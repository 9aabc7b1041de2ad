"""A real TorchServe in continuous-batching mode (``continuousBatching: true``): requests with
different step counts arrive staggered and each gets the image the request-level engine gives it
(for every scheduler);
a short request overtakes a long one; streamed progress ends with the image; a bad request
mid-flight fails alone."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import yaml

from handler.pipeline import SCHEDULERS
from scripts.server import TorchServe
from tests.integration.conftest import ROOT, Client, decode_png, serving, value

LONG = {"prompt": "a red circle", "seed": 1, "num_inference_steps": 60}
SHORT = {"prompt": "a blue square", "seed": 2, "num_inference_steps": 4}
MEDIUM = {"prompt": "a green triangle", "seed": 3, "num_inference_steps": 10}


@pytest.fixture(scope="module")
def continuous_server(tmp_path_factory) -> Iterator[TorchServe]:
    tmp = tmp_path_factory.mktemp("continuous")
    model_config = yaml.safe_load((ROOT / "model-config.yaml").read_text())
    model_config.update({"continuousBatching": True, "batchSize": 8, "maxBatchDelay": 10})
    (tmp / "model-config.yaml").write_text(yaml.safe_dump(model_config))
    with serving(tmp, tmp / "model-config.yaml") as server:
        yield server


@pytest.fixture(scope="module")
def continuous(continuous_server) -> Client:
    return Client(continuous_server)


def timed(client: Client, body: dict) -> tuple[requests.Response, float]:
    response = client.predict(body)
    return response, time.monotonic()


def test_staggered_requests_match_the_request_level_engine_and_short_ones_overtake(continuous, client):
    with ThreadPoolExecutor(3) as pool:
        long = pool.submit(timed, continuous, LONG)
        time.sleep(0.5)  # the long request is denoising when the others arrive
        short = pool.submit(timed, continuous, SHORT)
        medium = pool.submit(timed, continuous, MEDIUM)
        results = {"long": long.result(), "short": short.result(), "medium": medium.result()}
    for name, (response, _) in results.items():
        assert response.status_code == 200, (name, response.text)
        assert response.headers["Content-Type"] == "image/png"
    assert results["short"][1] < results["long"][1], "the 4-step request waited for the 60-step one"
    for name, body in {"long": LONG, "short": SHORT, "medium": MEDIUM}.items():
        expected = client.image(**body)
        difference = np.abs(decode_png(results[name][0].content).astype(np.int16) - expected.astype(np.int16))
        assert difference.max() <= 1, f"{name}: differs from the request-level engine by {difference.max()}"


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
def test_every_scheduler_gives_the_request_level_image_while_requests_join(continuous, client, scheduler):
    guidance = 1.0 if scheduler == "pndm" else 7.5  # pndm diverges at 7.5 on the default model
    body = {"prompt": "a yellow circle", "seed": 11, "num_inference_steps": 12, "scheduler": scheduler, "guidance_scale": guidance}
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(continuous.image, **body)
        time.sleep(0.1)
        joining = pool.submit(continuous.image, **{**body, "seed": 12, "num_inference_steps": 6})
        images = {"first": first.result(), "joining": joining.result()}
    for name, expected in {"first": client.image(**body), "joining": client.image(**{**body, "seed": 12, "num_inference_steps": 6})}.items():
        difference = np.abs(images[name].astype(np.int16) - expected.astype(np.int16))
        assert difference.max() <= 1, f"{scheduler} {name}: differs from the request-level engine by {difference.max()}"


def test_streamed_progress_parses_and_ends_with_the_image(continuous, client):
    response = requests.post(continuous.url, json={**SHORT, "stream": True}, headers=continuous.server.auth(), stream=True, timeout=120)
    assert response.status_code == 200 and response.headers["Content-Type"] == "application/x-ndjson"
    events = [json.loads(line) for line in response.iter_lines() if line]
    progress, done = events[:-1], events[-1]
    assert [event["step"] for event in progress] == [1, 2, 3]
    assert all(event["event"] == "progress" and event["total_steps"] == 4 for event in progress)
    assert done["event"] == "done" and done["seed"] == SHORT["seed"]
    image = decode_png(base64.b64decode(done["images"][0]))
    assert np.abs(image.astype(np.int16) - client.image(**SHORT).astype(np.int16)).max() <= 1


def test_a_bad_request_mid_flight_fails_alone(continuous):
    with ThreadPoolExecutor(2) as pool:
        long = pool.submit(continuous.predict, LONG)
        time.sleep(0.5)
        bad = continuous.predict({"prompt": "x", "num_inference_steps": 0})
        assert bad.status_code == 400
        assert bad.json()["errors"][0]["field"] == "num_inference_steps"
        assert long.result().status_code == 200


def test_continuous_batching_metrics_reach_the_metrics_endpoint(continuous, continuous_server):
    before = continuous_server.metric_samples()
    with ThreadPoolExecutor(2) as pool:
        responses = list(pool.map(continuous.predict, [MEDIUM, SHORT]))
    assert [response.status_code for response in responses] == [200, 200]
    after = continuous_server.metric_samples()
    image_steps = value(after, "sd_iteration_batch_size_sum") - value(before, "sd_iteration_batch_size_sum")
    assert image_steps == MEDIUM["num_inference_steps"] + SHORT["num_inference_steps"]
    assert value(after, "sd_iteration_batch_size_count") > value(before, "sd_iteration_batch_size_count")
    in_flight = ("sd_in_flight_requests", frozenset({"model_name": "stable-diffusion"}.items()))
    assert in_flight in after and after[in_flight] in (0, 1, 2)
