"""Soak: several hundred mixed requests at concurrency 8 on the default model."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from handler.config import UNET_SCHEDULERS
from tests.harness.images import decode_json_images, decode_png
from tests.harness.serving import workers

pytestmark = pytest.mark.slow

REQUESTS = 320
CONCURRENCY = 8
WARMUP = 24
MAX_RSS_GROWTH_MB = 256


def mixed_body(index: int) -> dict:
    chooser = random.Random(index)
    side = chooser.choice([64, 64, 64, 128])
    return {
        "prompt": chooser.choice(["a red circle", "a blue square", "a green triangle", "a yellow circle"]),
        "width": side,
        "height": chooser.choice([64, side]),
        "seed": index,
        "num_inference_steps": chooser.choice([2, 4, 6]),
        "num_images_per_prompt": chooser.choice([1, 1, 1, 2]),
        "scheduler": chooser.choice(UNET_SCHEDULERS),
        "output_format": chooser.choice(["png", "png", "jpeg", "webp"]),
        "response_format": chooser.choice(["image", "json"]),
    }


def worker_rss_mb(server) -> dict[int, float]:
    return {process.pid: process.memory_info().rss / 2**20 for process in workers(server)}


def check(client, index: int) -> str | None:
    body = mixed_body(index)
    response = client.predict(body)
    if response.status_code != 200:
        return f"request {index}: HTTP {response.status_code} {response.text[:200]}"
    if body["num_images_per_prompt"] == 1 and body["response_format"] == "image":
        if body["output_format"] == "png" and decode_png(response.content).shape != (body["height"], body["width"], 3):
            return f"request {index}: wrong image size"
    elif body["output_format"] == "png":
        shapes = {image.shape for image in decode_json_images(response.json())}
        if (
            shapes != {(body["height"], body["width"], 3)}
            or len(response.json()["images"]) != body["num_images_per_prompt"]
        ):
            return f"request {index}: wrong images"
    return None


def test_soak_answers_every_request_without_restarts_or_unbounded_memory(client, server, record_property):
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        assert [problem for problem in pool.map(lambda index: check(client, index), range(WARMUP)) if problem] == []
        before = worker_rss_mb(server)
        problems = [
            problem
            for problem in pool.map(lambda index: check(client, index), range(WARMUP, WARMUP + REQUESTS))
            if problem
        ]
    after = worker_rss_mb(server)
    assert problems == []
    assert set(after) == set(before), "a worker restarted during the soak"
    growth = max(after[pid] - before[pid] for pid in before)
    record_property("soak_worker_rss_growth_mb", round(growth, 1))
    print(
        f"soak: {REQUESTS} requests at concurrency {CONCURRENCY}, "
        f"worker RSS {before} -> {after} MB, growth {growth:.1f} MB"
    )
    assert growth < MAX_RSS_GROWTH_MB
