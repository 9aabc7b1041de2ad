"""Plain HTTP clients of a running TorchServe for the benchmarks (no locust, so they also run where
only ``requests`` is installed): one timed POST, and a closed loop of clients sending back to back."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import requests

from server import TorchServe

MAX_RETRIES = 2
# Longer than any answer takes (config.properties' default_response_timeout is 300 s): a request
# unanswered this long was lost.
ANSWER_TIMEOUT_S = 330.0


def post(server: TorchServe, body: dict, timeout: float = ANSWER_TIMEOUT_S) -> tuple[float, bool, int]:
    """Seconds until the answer, whether it was a 200, and how many times the request was sent
    again because its connection ended, or stayed open, without an answer within ``timeout`` (a
    server stopped, a worker TorchServe removed mid-batch: docs/reliability.md), with the same body,
    so the same seed and image."""
    started = time.monotonic()
    for retries in range(MAX_RETRIES + 1):
        try:
            response = requests.post(server.predictions_url, json=body, headers=server.auth(), timeout=timeout)
        except (requests.ConnectionError, requests.Timeout):
            continue
        except requests.RequestException:
            break
        return time.monotonic() - started, response.status_code == 200, retries
    return time.monotonic() - started, False, retries


def closed_loop(
    server: TorchServe, bodies: list[dict], concurrency: int
) -> tuple[list[tuple[float, bool, int]], float]:
    """Every body sent by ``concurrency`` clients, each sending its next as soon as its last is
    answered; each request's (seconds, ok, retries), and the seconds from the first send to the
    last answer."""
    started = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda body: post(server, body), bodies))
    return results, time.monotonic() - started
