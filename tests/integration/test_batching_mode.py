"""The batching mode follows the worker count, on real TorchServes: one worker serves the step
engine's continuous batching, several serve dynamic batching; scaling a continuous-batching model up
refuses the second worker without stalling the request in flight, and scaling back down works; a
streaming client that leaves frees its steps; the per-worker queue gauges in both modes."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from server import TorchServe, serve_archive, write_model_config
from server.paths import MODEL_CONFIG
from tests.harness.serving import (
    FAST,
    MODEL_DIR,
    STARTUP_TIMEOUT,
    Client,
    eventually,
    gauge,
    server_log,
    serving,
    settled_samples,
    value,
    wait_until_denoising,
    workers,
)

# Far longer than a second worker takes to start and load (seconds here), so the scale-up happens
# while it is in flight.
IN_FLIGHT = {"prompt": "a red circle", "seed": 11, "num_inference_steps": 500}
WAIT_S = 120  # fail-safe bound; a stalled request would wait for the response timeout


def test_one_worker_serves_continuous_batching_and_the_describe_api_says_so(server):
    described = server.describe()
    assert described["continuousBatching"] is True
    assert (described["minWorkers"], described["maxWorkers"], len(described["workers"])) == (1, 1, 1)


def test_several_workers_serve_dynamic_batching_and_scale_down(tmp_path):
    """Two GPUs' worth of workers (on this CPU host: two CPU workers): packaging ships dynamic batching."""
    with serve_archive(MODEL_DIR, MODEL_CONFIG, tmp_path, STARTUP_TIMEOUT, gpus=2, stop_grace=0) as server:
        eventually(lambda: server.worker_status() == ["READY", "READY"], "two ready workers")
        described = server.describe()
        assert described["continuousBatching"] is False and described["minWorkers"] == 2
        client = Client(server)
        with ThreadPoolExecutor(4) as pool:
            statuses = list(pool.map(lambda seed: client.predict({"prompt": "x", "seed": seed, **FAST}), range(4)))
        assert [response.status_code for response in statuses] == [200] * 4
        assert server.scale(1).status_code == 200
        assert server.worker_status() == ["READY"] and client.predict({"prompt": "x", **FAST}).status_code == 200


@pytest.fixture(scope="module")
def scaled(tmp_path_factory) -> Iterator[TorchServe]:
    """The shipped configuration on a server of its own (a refused worker keeps being retried by
    TorchServe for minutes), allowing a request long enough to outlast a worker's start."""
    tmp = tmp_path_factory.mktemp("scaling")
    config = write_model_config(tmp, handler={"limits": {"max_inference_steps": IN_FLIGHT["num_inference_steps"]}})
    with serving(tmp, config) as server:
        yield server


def test_scaling_up_continuous_batching_refuses_the_second_worker_and_stalls_nothing(scaled):
    client = Client(scaled)
    (first,) = workers(scaled)
    with ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(client.predict, IN_FLIGHT)
        wait_until_denoising(scaled)
        refused = scaled.scale(2)
        assert not in_flight.done(), "the scale-up happened while the request was in flight"
        # Nothing else is sent until it is answered: with a second worker polling the queue, it
        # would wait for a later arrival (or the response timeout).
        assert in_flight.result(timeout=WAIT_S).status_code == 200
    assert refused.status_code == 500 and "Failed to start workers" in refused.text
    statuses = {worker["pid"]: worker["status"] for worker in scaled.describe()["workers"]}
    assert statuses[first.pid] == "READY" and list(statuses.values()).count("READY") == 1
    log = server_log(scaled, "model_log")
    assert "runs continuous batching, and another worker of it is already serving" in log
    assert "min_worker=1&max_worker=1" in log and "continuousBatching: false" in log
    assert client.predict({"prompt": "still serving", **FAST}).status_code == 200
    assert scaled.scale(1).status_code == 200
    (worker,) = scaled.describe()["workers"]
    assert (worker["pid"], worker["status"]) == (first.pid, "READY")
    assert client.predict({"prompt": "after scaling down", **FAST}).status_code == 200


def test_a_streaming_client_that_leaves_frees_its_steps(server):
    """TorchServe drops a continuous-batching job whose connection closed: no later iteration steps
    it. The worker learns it at its next call (the first without the job's id), forgets the
    request and counts it."""
    before = settled_samples(Client(server))
    # 256 px: each call of the 100 ms iteration budget takes a few of its 100 steps, on any device
    body = {"prompt": "leaving early", "num_inference_steps": 100, "width": 256, "height": 256, "stream": True}
    with requests.post(server.predictions_url, json=body, headers=server.auth(), stream=True, timeout=60) as response:
        assert json.loads(next(response.iter_lines()))["event"] == "progress"

    def image_steps() -> float:
        return value(server.metric_samples(), "sd_iteration_batch_size_sum") - value(
            before, "sd_iteration_batch_size_sum"
        )

    readings = [image_steps()]
    # The calls under way when it left end, and their metrics reach the endpoint (TorchServe parses
    # the worker's metric lines on its own time): unchanged for 2 s.
    while len(readings) < 5 or len(set(readings[-5:])) > 1:
        time.sleep(0.5)
        readings.append(image_steps())
    taken = readings[-1]
    assert 0 < taken < body["num_inference_steps"], f"{taken} of its steps were taken"
    assert Client(server).predict({"prompt": "the next call", **FAST}).status_code == 200
    after = settled_samples(Client(server))  # the barrier request is refused before any step
    cancelled = value(after, "sd_cancelled_requests_total", reason="client_gone")
    assert cancelled == value(before, "sd_cancelled_requests_total", reason="client_gone") + 1
    stepped = value(after, "sd_iteration_batch_size_sum") - value(before, "sd_iteration_batch_size_sum")
    assert stepped == taken + FAST["num_inference_steps"], "the next call stepped the new request only"
    eventually(lambda: gauge(server, "sd_in_flight_requests") == 0, "an empty denoising loop")


@pytest.mark.parametrize("mode", ["dynamic", "continuous"])
def test_the_queue_gauges_follow_a_request_through_the_worker(request, mode):
    server = request.getfixturevalue(f"{mode}_server")
    body = {"prompt": "count me", "num_inference_steps": 100, "num_images_per_prompt": 4, "width": 128, "height": 128}
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(Client(server).predict, body)
        eventually(lambda: gauge(server, "sd_in_flight_images") == 4, "four images in flight")
        assert gauge(server, "sd_in_flight_requests") == 1 and gauge(server, "sd_waiting_requests") == 0
        assert answer.result().status_code == 200
    eventually(lambda: gauge(server, "sd_in_flight_images") == 0, "no image in flight")
    assert gauge(server, "sd_in_flight_requests") == 0
