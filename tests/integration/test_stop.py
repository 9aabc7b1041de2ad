"""Stopping a server loses no request: on SIGTERM the start script (what `make serve`, `make stop`,
the container and a Kubernetes pod run) drains, in both batching modes. The requests in flight
finish with their images, a request sent during the drain gets 503 with Retry-After (with
continuous batching with room in the batch, before any request in flight finishes; with dynamic
batching once the worker is free), the health check fails, and no process is left; a client that
left does not hold the drain; past the grace period what is left is answered 503, not dropped."""

from __future__ import annotations

import json
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from server import write_model_config
from tests.harness.serving import Client, eventually, value
from tests.harness.start_script import group_members, healthcheck, server_process_group, start_script

IN_FLIGHT = 8
# Long enough that the 8 are still denoising while the test checks the drain, a few seconds (served,
# the default model steps 8 images of 64x64 about 20 times a second here: 10 s; the late request is
# refused about a second after they start), short of the stop's grace period.
LONG = {"prompt": "a blue square", "num_inference_steps": 200}
# Longer than the grace period of 4 s given to it (one image steps about 130 times a second here).
LONGEST = {"prompt": "a red circle", "num_inference_steps": 990, "seed": 3}
LIMITS = {"limits": {"max_inference_steps": LONGEST["num_inference_steps"]}}
# Not a timing check: a read that waits this long means the answer was lost (a loaded machine is slow).
READ_TIMEOUT_S = 600
DRAINED = re.compile(r"drained in ([0-9.]+) s \((\d+) request\(s\) left unanswered\)")


def in_flight(server) -> float:
    samples = server.metric_samples()
    return sum(value(samples, "sd_in_flight_requests", worker=worker["id"]) for worker in server.describe()["workers"])


def answered(client: Client, body: dict):
    """The response, and when it came (monotonic seconds)."""
    response = client.predict(body, timeout=READ_TIMEOUT_S)
    return response, time.monotonic()


def outcome(flight) -> tuple:
    """A flight's (status, Content-Type, when) or the exception it raised, so every flight is reported."""
    error = flight.exception()
    if error is not None:
        return (type(error).__name__, str(error)[:200], None)
    response, at = flight.result()
    return (response.status_code, response.headers.get("Content-Type"), at)


@pytest.mark.parametrize("continuous", [True, False], ids=["continuous", "dynamic"])
def test_sigterm_drains_the_requests_in_flight_and_stops_leaving_no_process(tmp_path, continuous):
    # Room for more than the 8 (with continuous batching a full batch lets no request join until one
    # finishes), and with dynamic batching a delay long enough that the 8 form one batch.
    config = write_model_config(
        tmp_path, handler=LIMITS, continuousBatching=continuous, batchSize=2 * IN_FLIGHT, maxBatchDelay=3000
    )
    with start_script(tmp_path, MODEL_CONFIG=str(config)) as started:
        client = Client(started.server)
        group = server_process_group(tmp_path / "model_store")
        with ThreadPoolExecutor(IN_FLIGHT) as pool:
            flights = [pool.submit(answered, client, {**LONG, "seed": seed}) for seed in range(IN_FLIGHT)]
            eventually(lambda: in_flight(started.server) == IN_FLIGHT, "8 requests denoising")
            started.process.send_signal(signal.SIGTERM)
            eventually(lambda: (started.runtime / "control" / "draining").exists(), "the drain to begin")
            late, late_at = answered(client, {"prompt": "too late", "num_inference_steps": 4})
            check = healthcheck(started.runtime)
            outcomes = [outcome(flight) for flight in flights]  # each waits for its flight
        assert [status for status, _, _ in outcomes] == [200] * IN_FLIGHT, outcomes
        assert all(content_type == "image/png" for _, content_type, _ in outcomes), outcomes
        assert check.returncode == 1 and "stopping" in check.stdout, check.stdout
        assert late.status_code == 503 and late.headers["Retry-After"] == "1", late.text
        assert late.json()["type"] == "ShuttingDown"
        if continuous:  # refused in the next iteration, while the 8 still denoise
            assert late_at < min(at for _, _, at in outcomes)
        assert started.process.wait(timeout=READ_TIMEOUT_S) == 0
        output = started.process.stdout.read()
    drained = DRAINED.search(output)
    assert drained and drained.group(2) == "0", output[-3000:]
    assert group_members(group) == [], "TorchServe processes outlived the start script"
    assert healthcheck(started.runtime).returncode == 1


def test_a_client_that_left_does_not_hold_the_drain(tmp_path):
    """Continuous batching: TorchServe drops a request whose client left and, with no request left,
    calls the worker no more, so the worker would count it in flight until the grace period ends.
    The drain's probe shows the worker which clients left: nothing is left unanswered."""
    config = write_model_config(tmp_path, handler=LIMITS, continuousBatching=True)
    with start_script(tmp_path, MODEL_CONFIG=str(config), STOP_GRACE_SECONDS="60") as started:
        client = Client(started.server)
        with client.predict({**LONGEST, "stream": True}, stream=True) as leaving:
            assert leaving.status_code == 200 and next(leaving.iter_lines()), leaving.status_code
        # its client left; TorchServe drops it at its next progress line, and nothing calls the worker since
        eventually(lambda: in_flight(started.server) == 1, "the request counted in flight")
        started.process.send_signal(signal.SIGTERM)
        assert started.process.wait(timeout=READ_TIMEOUT_S) == 0
        output = started.process.stdout.read()
    drained = DRAINED.search(output)
    assert drained and drained.group(2) == "0", output[-3000:]
    assert "probing for clients that left" in output, output[-3000:]


@pytest.mark.parametrize("continuous", [True, False], ids=["continuous", "dynamic"])
def test_what_is_left_when_the_grace_period_ends_is_answered_503(tmp_path, continuous):
    config = write_model_config(tmp_path, handler=LIMITS, continuousBatching=continuous)
    with start_script(tmp_path, MODEL_CONFIG=str(config), STOP_GRACE_SECONDS="4") as started:
        client = Client(started.server)
        with ThreadPoolExecutor(1) as pool:
            flight = pool.submit(client.predict, LONGEST)
            eventually(lambda: in_flight(started.server) == 1, "the request denoising")
            started.process.send_signal(signal.SIGTERM)
            answer = flight.result()
        assert started.process.wait(timeout=300) == 0
        output = started.process.stdout.read()
    if continuous:  # its 200 left with its first (empty) part; the body says what happened
        assert answer.status_code == 200 and answer.headers["Content-Type"] == "image/png"
        error = json.loads(answer.content)
    else:
        assert answer.status_code == 503 and answer.headers["Retry-After"] == "1"
        error = answer.json()
    assert error["type"] == "ShuttingDown" and "grace period" in error["message"], error
    assert DRAINED.search(output), output[-3000:]
