"""Faults and security on servers of their own (so killing workers or filling a queue does not
disturb other tests): a killed worker, overload, out of memory in steps and decodes, a request's
time limit in both batching modes, loopback binding, allowed_urls, prompts kept out of the logs."""

from __future__ import annotations

import ipaddress
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import requests

from server import TorchServe
from server import write_model_config as model_config
from tests.harness.images import assert_same_image, decode_json_images
from tests.harness.serving import (
    FAST,
    SHIPPED_CONTINUOUS,
    Client,
    eventually,
    group_processes,
    run_behind_blocker,
    server_log,
    serving,
    value,
    wait_until_denoising,
    wait_until_serving,
    workers,
)

RESPONSE_TIMEOUT_S = 5
JOB_QUEUE_SIZE = 4
# A UNet forward of up to 3 images of 64x64 fits, 4 do not (the step profile finds it at start);
# a VAE decode of more than two 64x64 images runs out of memory, and so does the postprocess (the
# safety checker's place) of more than one.
FAULTS = {
    "out_of_memory_above_pixels": 3 * 64 * 64,
    "vae_out_of_memory_above_pixels": 2 * 64 * 64,
    "postprocess_out_of_memory_above_pixels": 64 * 64,
}
SHORT_BLOCKER = {"prompt": "keep the worker busy", "num_inference_steps": 30, "seed": 0}
# Well past RESPONSE_TIMEOUT_S (about 10 s of work here; SD's schedulers take fewer than 1000 steps)
# without tripping the OOM injection; the servers with the short response timeout allow this many steps.
TOO_SLOW = {"prompt": "too slow", "num_inference_steps": 900, "num_images_per_prompt": 3}


@pytest.fixture(scope="module")
def fault_server(tmp_path_factory) -> Iterator[TorchServe]:
    tmp = tmp_path_factory.mktemp("faults")
    config = model_config(
        tmp,
        handler={"fault_injection": FAULTS, "limits": {"max_inference_steps": TOO_SLOW["num_inference_steps"]}},
        responseTimeout=RESPONSE_TIMEOUT_S,
    )
    with serving(tmp, config, job_queue_size=str(JOB_QUEUE_SIZE), enable_model_api="true") as server:
        yield server


@pytest.fixture(scope="module")
def fault_client(fault_server) -> Client:
    return Client(fault_server)


def test_a_request_too_large_alone_is_refused_at_admission_with_507(fault_client):
    too_large = fault_client.predict({"prompt": "x", "num_images_per_prompt": 4, **FAST})
    assert too_large.status_code == 507, "the status must be the request's own, also with continuous batching"
    assert "even alone" in too_large.json()["message"] and "4 image(s) of 64x64" in too_large.json()["message"]


def test_concurrent_requests_are_stepped_within_the_measured_memory_cap(fault_client, fault_server):
    before = fault_server.metric_samples()
    bodies = [{"prompt": f"p{index}", "seed": index, "response_format": "json", **FAST} for index in range(4)]
    responses = run_behind_blocker(fault_client, bodies, SHORT_BLOCKER)
    assert [response.status_code for response in responses] == [200] * 4
    assert all(response.json()["batch"]["max_step_images"] <= 2 for response in responses)
    after = fault_server.metric_samples()
    assert value(after, "sd_oom_retries_total", stage="step") == value(before, "sd_oom_retries_total", stage="step"), (
        "a forward ran out of memory"
    )


@pytest.mark.parametrize(("images", "stage"), [(3, "vae_decode"), (2, "postprocess")])
def test_a_decode_that_runs_out_of_memory_is_retried_image_by_image(fault_client, fault_server, client, images, stage):
    """Out of memory in the VAE decode (3 images), or after it in the postprocess, where a safety
    checker runs (2 images): retried image by image, counted by stage, the images unchanged."""
    before = fault_server.metric_samples()
    body = {"prompt": "at once", "seed": 9, "num_images_per_prompt": images, "response_format": "json", **FAST}
    response = fault_client.predict(body)
    assert response.status_code == 200, response.text
    retries: dict[str, float] = {}

    def counted() -> bool:
        """The frontend parses the worker's metric lines apart from its answers."""
        after = fault_server.metric_samples()
        for name in ("vae_decode", "postprocess"):
            retries[name] = value(after, "sd_oom_retries_total", stage=name) - value(
                before, "sd_oom_retries_total", stage=name
            )
        return sum(retries.values()) > 0

    eventually(counted, "the retry counted", timeout=30)
    assert retries == {name: int(name == stage) for name in retries}
    for retried, expected in zip(
        decode_json_images(response.json()), decode_json_images(client.predict(body).json()), strict=True
    ):
        assert_same_image(retried, expected)


@pytest.fixture(scope="module", params=["dynamic", "continuous"])
def mode_client(request, tmp_path_factory, fault_client) -> Iterator[tuple[str, Client]]:
    """A server with the short response timeout in each batching mode (the fault server is one)."""
    continuous = request.param == "continuous"
    if continuous == SHIPPED_CONTINUOUS:
        yield request.param, fault_client
        return
    tmp = tmp_path_factory.mktemp(f"faults-{request.param}")
    config = model_config(
        tmp,
        handler={"limits": {"max_inference_steps": TOO_SLOW["num_inference_steps"]}},
        continuousBatching=continuous,
        responseTimeout=RESPONSE_TIMEOUT_S,
    )
    with serving(tmp, config) as server:
        yield request.param, Client(server)


def test_a_killed_worker_fails_its_request_clearly_and_is_replaced(mode_client, record_property):
    """Dynamic batching answers 5xx. With continuous batching the status left with the first chunk,
    so the client sees its chunked answer broken off, never a complete image."""
    mode, client = mode_client
    (victim,) = workers(client.server)
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        pending = pool.submit(client.predict, {"prompt": "killed", "num_inference_steps": 300})
        wait_until_denoising(client.server)
        victim.send_signal(signal.SIGKILL)
        try:
            response = pending.result(timeout=RESPONSE_TIMEOUT_S + 60)
            outcome = " ".join(response.text.split())[:160]
            assert 500 <= response.status_code < 600, response.text
        except requests.exceptions.ChunkedEncodingError:
            outcome = "chunked answer broken off"
            assert mode == "continuous", "a dynamic batch's answer is not chunked"
        answered_after = time.monotonic() - started
    recovery = wait_until_serving(client)
    record_property(f"killed_worker_answered_after_s_{mode}", round(answered_after, 2))
    record_property(f"killed_worker_recovery_s_{mode}", round(recovery, 2))
    print(f"killed worker ({mode}): {outcome} after {answered_after:.1f} s, serving again after {recovery:.1f} s")
    assert [process.pid for process in workers(client.server)] != [victim.pid]


def test_continuous_batching_with_more_than_one_worker_is_refused_at_load(tmp_path):
    config = model_config(tmp_path, continuousBatching=True, minWorkers=2, maxWorkers=2)
    with pytest.raises(RuntimeError, match="one worker per model"):
        with serving(tmp_path, config):
            pass


def test_a_request_past_its_time_limit_is_cancelled_and_the_worker_keeps_serving(mode_client):
    """The worker cancels a request whose next step would end past ``request_timeout_s`` (90% of
    responseTimeout here): a dynamic batch is answered before TorchServe's response timeout would
    kill the worker with it, and continuous batching, which TorchServe bounds per call only, bounds
    the request too. A continuous-batching answer sent its 200 with its first (empty) part, so the
    error arrives as its body."""
    mode, client = mode_client
    (worker,) = workers(client.server)
    before = client.server.metric_samples()
    response = client.predict(TOO_SLOW)
    error = response.json()
    assert error["type"] == "DeadlineExceeded" and "handler.request_timeout_s" in error["message"], error
    assert response.status_code == (504 if mode == "dynamic" else 200)
    assert [process.pid for process in workers(client.server)] == [worker.pid], "the worker was not killed"
    cancelled = value(before, "sd_cancelled_requests_total", reason="deadline")
    eventually(
        lambda: value(client.server.metric_samples(), "sd_cancelled_requests_total", reason="deadline") > cancelled,
        "the cancel counted",
        timeout=30,
    )
    assert value(client.server.metric_samples(), "sd_cancelled_requests_total", reason="deadline") == cancelled + 1
    assert client.predict({"prompt": "served next", **FAST}).status_code == 200
    print(f"time limit, {mode} batching: {response.status_code}, {error['message']}")


def test_overload_gets_fast_503s_and_the_server_serves_normally_afterwards(fault_client):
    def timed(index: int) -> tuple[int, float]:
        started = time.monotonic()
        status = fault_client.predict({"prompt": f"flood {index}", "num_inference_steps": 8}).status_code
        return status, time.monotonic() - started

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(timed, range(32)))
    statuses = [status for status, _ in results]
    assert set(statuses) <= {200, 503}, statuses
    assert statuses.count(503) >= 1 and statuses.count(200) >= JOB_QUEUE_SIZE
    assert max(seconds for status, seconds in results if status == 503) < 5
    assert max(seconds for _, seconds in results) < RESPONSE_TIMEOUT_S * 4
    assert wait_until_serving(fault_client) < 30


def test_every_port_binds_to_loopback(server):
    listening = [
        connection.laddr
        for process in group_processes(server)
        for connection in process.net_connections(kind="inet")
        if connection.status == psutil.CONN_LISTEN
    ]
    assert len(listening) >= 5  # inference, management, metrics, gRPC inference and management
    for address in listening:
        ip = ipaddress.ip_address(address.ip)
        assert ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback), (
            address
        )


@pytest.mark.parametrize(
    "url", ["https://example.com/stable-diffusion.mar", "file:///etc/passwd", "http://127.0.0.1:9/stable-diffusion.mar"]
)
def test_allowed_urls_restrict_registration_to_the_local_model_store(fault_server, url):
    response = requests.post(
        f"{fault_server.addresses.management}/models",
        params={"url": url},
        headers=fault_server.auth(management=True),
        timeout=30,
    )
    assert response.status_code == 404, response.text
    assert "does not match any allowed URL(s)" in response.json()["message"]


def test_prompts_stay_out_of_the_logs(client, server):
    secret, rejected_secret = "zebra-plaid-unique-4711", "okapi-tartan-unique-4712"
    assert client.predict({"prompt": secret, **FAST}).status_code == 200
    assert client.predict({"prompt": rejected_secret, "width": 100, **FAST}).status_code == 400

    def logs() -> str:
        return "".join(server_log(server, path.stem) for path in (server.workdir / "logs").glob("*.log"))

    eventually(lambda: "rejected: width (multiple_of)" in logs(), "the refusal in the logs", timeout=30)
    assert secret not in logs() and rejected_secret not in logs()
