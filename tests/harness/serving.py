"""A real TorchServe on loopback serving the real archive, and what the tests do with one: a client
bound to it and its keys, metric values, requests batched behind a busy worker, its processes."""

from __future__ import annotations

import gzip
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import psutil
import pytest
import requests
import yaml

from server import TorchServe, serve_archive
from server.archive import serving_defaults
from server.paths import DEFAULT_MODEL_DIR, MODEL_CONFIG
from tests.harness.images import decode_png

MODEL_DIR = DEFAULT_MODEL_DIR
STARTUP_TIMEOUT = 600
SHIPPED_CONFIG = yaml.safe_load(MODEL_CONFIG.read_text())
# The mode the test servers run with the shipped model-config.yaml: packaged for one worker.
SHIPPED_CONTINUOUS = serving_defaults(SHIPPED_CONFIG, gpus=1)[0]["continuousBatching"]
FAST = {"num_inference_steps": 4}
# Long enough to keep the worker busy while followers queue up behind it (the default model
# runs ~30 steps/s at 64x64 here; on a faster machine the followers may still be batched).
BLOCKER = {"prompt": "keep the worker busy", "num_inference_steps": 100, "seed": 0}
RECOVERY_TIMEOUT_S = 180


@contextmanager
def serving(
    tmp: Path, config: Path = MODEL_CONFIG, model_dir: Path = MODEL_DIR, **properties: str
) -> Iterator[TorchServe]:
    """The real archive of ``model_dir`` (a diffusers directory or a single-file checkpoint), built
    with ``config``, served on free loopback ports (config.properties plus ``properties``) until the
    block ends."""
    if not (model_dir / "model_index.json").is_file() and model_dir.suffix != ".safetensors":
        pytest.fail(
            f"{model_dir} is missing: the default model is committed (`make train-default-model` rebuilds "
            "it); the tiny ones come from `make model`"
        )
    # One worker, GPU or not; killed when the block ends (its state is not kept, and TorchServe's
    # graceful stop takes seconds: the stop tests run the start script's).
    with serve_archive(model_dir, config, tmp, STARTUP_TIMEOUT, gpus=1, stop_grace=0, **properties) as server:
        yield server


class Client:
    """Small HTTP helper bound to one server and its keys."""

    def __init__(self, server: TorchServe):
        self.server = server
        self.url = server.predictions_url

    def predict(
        self, body=None, *, data=None, content_type="application/json", headers=None, timeout=120, **kwargs
    ) -> requests.Response:
        """``timeout``: seconds a read may wait (a request not streamed sends nothing until it is done)."""
        all_headers = {
            **self.server.auth(),
            **({"Content-Type": content_type} if content_type else {}),
            **(headers or {}),
        }
        if body is not None:
            return requests.post(self.url, json=body, headers=all_headers, timeout=timeout, **kwargs)
        return requests.post(self.url, data=data, headers=all_headers, timeout=timeout, **kwargs)

    def image(self, **fields) -> np.ndarray:
        """One image as an array, asserting success."""
        response = self.predict({**FAST, **fields})
        assert response.status_code == 200, response.text
        return decode_png(response.content)


def worker_processes(server: TorchServe) -> list[tuple[str, int, str]]:
    """(id, pid, startTime) of each worker, from the management API's describe; all READY."""
    workers = server.describe()["workers"]
    assert workers and all(worker["status"] == "READY" for worker in workers), workers
    return sorted((worker["id"], worker["pid"], worker["startTime"]) for worker in workers)


def server_log(server: TorchServe, name: str) -> str:
    """What the server wrote to ``logs/<name>.log`` (``ts_log``, ``model_log``, ...), with what log4j2
    rolled over from it (server/log4j2.xml: daily, or past 100 MB, gzipped): a run that crosses
    midnight has its lines in both."""
    logs = server.workdir / "logs"
    rolled = sorted(logs.glob(f"{name}.*.log.gz"), key=lambda path: path.stat().st_mtime)
    older = "".join(gzip.decompress(path.read_bytes()).decode(errors="replace") for path in rolled)
    return older + (logs / f"{name}.log").read_text(errors="replace")


def value(samples, name: str, **labels) -> float:
    return samples.get((name, frozenset({"model_name": "stable-diffusion", **labels}.items())), 0.0)


def worker_of(server: TorchServe) -> str:
    """The id of the server's one worker, as the describe API and the per-worker gauges name it."""
    (worker,) = server.describe()["workers"]
    return worker["id"]


def gauge(server: TorchServe, name: str) -> float:
    """A per-worker gauge of the server's one worker (``sd_in_flight_requests``, ...)."""
    return value(server.metric_samples(), name, worker=worker_of(server))


def eventually(condition, what: str, timeout: float = RECOVERY_TIMEOUT_S) -> None:
    """Poll ``condition`` until it holds: the frontend parses the worker's metric lines as they come.
    ``timeout`` is a fail-safe, not a measurement."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.05)


def settled_samples(client: Client) -> dict[tuple[str, frozenset], float]:
    """The server's metric samples once every line its worker wrote before now is parsed: the
    frontend parses a worker's metric lines apart from its answers, and a worker records a request's
    latency after its answer left. The barrier is a request the worker refuses, whose line follows
    theirs; it adds one to ``ts_inference_requests_total`` and to ``sd_invalid_requests_total``
    under ``num_inference_steps``. One worker: another's lines are not behind the barrier."""
    field = {"field": "num_inference_steps"}
    refused = value(client.server.metric_samples(), "sd_invalid_requests_total", **field)
    response = client.predict({"prompt": "a metrics barrier", "num_inference_steps": 0})
    assert response.status_code == 400, response.text
    latest: dict[str, dict[tuple[str, frozenset], float]] = {}

    def parsed() -> bool:
        latest["samples"] = client.server.metric_samples()
        return value(latest["samples"], "sd_invalid_requests_total", **field) > refused

    eventually(parsed, "the barrier request's refusal in the metrics", timeout=30)
    return latest["samples"]


def wait_until_denoising(server: TorchServe, requests_in_flight: int = 1) -> None:
    """Until the worker holds this many requests in its denoising loop."""
    eventually(lambda: gauge(server, "sd_in_flight_requests") == requests_in_flight, "requests in the denoising loop")


def run_behind_blocker(client, bodies: list[dict], blocker_body: dict = BLOCKER) -> list[requests.Response]:
    """Send ``bodies`` concurrently while the worker is busy, so TorchServe batches them."""
    with ThreadPoolExecutor(len(bodies) + 1) as pool:
        blocker = pool.submit(client.predict, blocker_body)
        eventually(
            lambda: blocker.done() or gauge(client.server, "sd_in_flight_requests") == 1,
            "the blocker in the denoising loop",
        )
        followers = [pool.submit(client.predict, body) for body in bodies]
        assert blocker.result().status_code == 200, blocker.result().text
        return [future.result() for future in followers]


def group_processes(server: TorchServe) -> list[psutil.Process]:
    """The frontend and its workers (they share the server's process group)."""
    group = os.getpgid(server.process.pid)
    members = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if os.getpgid(process.pid) == group:
                members.append(process)
        except ProcessLookupError:
            continue
    return members


def workers(server: TorchServe) -> list[psutil.Process]:
    return [
        process
        for process in group_processes(server)
        if "model_service_worker" in " ".join(process.info["cmdline"] or [])
    ]


def wait_until_serving(client: Client) -> float:
    """Seconds until a valid request succeeds again."""
    started = time.monotonic()
    while time.monotonic() - started < RECOVERY_TIMEOUT_S:
        try:
            if client.predict({"prompt": "are you back", **FAST}).status_code == 200:
                return time.monotonic() - started
        except requests.RequestException:
            pass
        time.sleep(1)
    raise AssertionError(f"the server did not serve again within {RECOVERY_TIMEOUT_S} s")
