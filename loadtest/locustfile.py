"""Locust users for the stable-diffusion endpoint.

Each user sends requests drawn from ``request_mix`` (benchmark_config.yaml) with prompts from the
prompt file, the inference key from ``LOADTEST_KEY``, and checks that every response is a valid
image of the requested size. A request whose connection ended, or stayed open, without an answer
within ``ANSWER_TIMEOUT_S`` (a server stopped, a worker TorchServe removed mid-batch:
docs/reliability.md) is sent again with the same seed, so it gets the same image, up to
``MAX_RETRIES`` times; locust reports those attempts as ``RETRY``.
``LOADTEST_MAX_REQUESTS`` stops the run after that many requests; ``LOADTEST_REQUEST_LOG`` names a
CSV that gets one row per request (name, success, latency of its last attempt, images, end time,
retries), from which exact percentiles are computed (locust's own CSV rounds response times above
100 ms to two significant digits).

    LOADTEST_KEY=... locust -f loadtest/locustfile.py --headless -u 8 -r 8 -t 60s --host http://127.0.0.1:8080
"""

from __future__ import annotations

import base64
import csv
import io
import os
import random
import time
from pathlib import Path

import gevent
from locust import HttpUser, constant, events, task
from PIL import Image

from loadtest.config import BenchmarkConfig, MixEntry
from server.paths import BENCHMARK_CONFIG

CONFIG = BenchmarkConfig.load(Path(os.environ.get("LOADTEST_CONFIG", BENCHMARK_CONFIG)))
PROMPTS = CONFIG.prompts()
MODEL_NAME = os.environ.get("LOADTEST_MODEL", CONFIG.model.name)
MAX_REQUESTS = int(os.environ.get("LOADTEST_MAX_REQUESTS", "0"))
REQUEST_LOG_COLUMNS = ["name", "ok", "latency_s", "images", "end_time", "retries"]
MAX_RETRIES = 2
ANSWER_TIMEOUT_S = 330.0  # longer than any answer takes (default_response_timeout: 300 s)
RETRY = "RETRY"  # the request type locust reports an attempt under when it is sent again
_request_log = None
_answered = 0


@events.init.add_listener
def _open_request_log(environment, **kwargs) -> None:
    global _request_log
    path = os.environ.get("LOADTEST_REQUEST_LOG")
    if path:
        _request_log = csv.writer(open(path, "w", newline="", buffering=1))
        _request_log.writerow(REQUEST_LOG_COLUMNS)


@events.request.add_listener
def _record_and_stop_after_max_requests(name, response_time, exception, context, request_type, **kwargs) -> None:
    """Log the request (not an attempt sent again); quit the run once ``LOADTEST_MAX_REQUESTS`` were
    answered (0: no limit)."""
    global _answered
    if request_type == RETRY:
        return
    _answered += 1
    if _request_log is not None:
        images = context.get("images", 0) if exception is None else 0
        row = [name, int(exception is None), response_time / 1000, images, time.time(), context.get("retries", 0)]
        _request_log.writerow(row)
    if MAX_REQUESTS and _answered == MAX_REQUESTS and context.get("runner") is not None:
        gevent.spawn(context["runner"].quit)


def check_images(response, entry: MixEntry) -> str | None:
    """None when the response holds the requested images, else what is wrong."""
    expected = (entry.width, entry.height)
    try:
        if entry.num_images_per_prompt == 1:
            if response.headers.get("Content-Type") != "image/png":
                return f"Content-Type {response.headers.get('Content-Type')!r}, expected image/png"
            blobs = [response.content]
        else:
            blobs = [base64.b64decode(item) for item in response.json()["images"]]
            if len(blobs) != entry.num_images_per_prompt:
                return f"{len(blobs)} images, expected {entry.num_images_per_prompt}"
        sizes = [Image.open(io.BytesIO(blob)).size for blob in blobs]
    except Exception as error:  # any undecodable answer is a failed request
        return f"not a valid image response: {type(error).__name__}: {error}"
    wrong = [size for size in sizes if size != expected]
    return f"image size {wrong[0]}, expected {expected}" if wrong else None


class StableDiffusionUser(HttpUser):
    """A closed-loop client: sends the next request as soon as the previous one is answered."""

    wait_time = constant(0)

    def on_start(self) -> None:
        self.random = random.Random()
        self.headers = {"Authorization": f"Bearer {os.environ['LOADTEST_KEY']}"}

    @task
    def generate(self) -> None:
        entry = self.random.choices(CONFIG.request_mix, weights=[item.weight for item in CONFIG.request_mix])[0]
        body = entry.body(self.random.choice(PROMPTS), self.random.randrange(2**32))
        for retries in range(MAX_RETRIES + 1):
            context = {"runner": self.environment.runner, "images": entry.num_images_per_prompt, "retries": retries}
            with self.client.post(
                f"/predictions/{MODEL_NAME}",
                json=body,
                headers=self.headers,
                name=entry.name,
                catch_response=True,
                context=context,
                timeout=ANSWER_TIMEOUT_S,
            ) as response:
                if response.status_code == 0 and retries < MAX_RETRIES:  # no answer: the connection ended or timed out
                    response.request_meta["request_type"] = RETRY
                    response.failure(f"no answer ({response.error}); sent again with the same seed")
                    continue
                if response.status_code != 200:
                    response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
                else:
                    problem = check_images(response, entry)
                    if problem:
                        response.failure(problem)
            return
