"""Plain HTTP clients of a running TorchServe for the benchmarks (no locust, so they also run where
only ``requests`` is installed): one timed POST, and a closed loop of clients sending back to back."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import requests

from server import TorchServe


def post(server: TorchServe, body: dict, timeout: float = 600) -> tuple[float, bool]:
    """Seconds until the answer, and whether it was a 200."""
    started = time.monotonic()
    try:
        ok = requests.post(server.predictions_url, json=body, headers=server.auth(), timeout=timeout).status_code == 200
    except requests.RequestException:
        ok = False
    return time.monotonic() - started, ok


def closed_loop(server: TorchServe, bodies: list[dict], concurrency: int) -> tuple[list[tuple[float, bool]], float]:
    """Every body sent by ``concurrency`` clients, each sending its next as soon as its last is
    answered; each request's (seconds, ok), and the seconds from the first send to the last answer."""
    started = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda body: post(server, body), bodies))
    return results, time.monotonic() - started
