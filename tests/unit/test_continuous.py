"""The continuous-batching service in-process: staggered requests, streaming, a bad request
mid-flight, clients that leave, and the deadline-slack choice under the profile's cap."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image

from handler.config import FaultInjection, HandlerSettings
from handler.continuous import STREAM_CONTENT_TYPE, build_continuous_service
from handler.service import IncomingRequest, build_service
from scripts.build_mar import DEFAULT_MODEL_DIR

SETTINGS = HandlerSettings(model_path=str(DEFAULT_MODEL_DIR), max_images_per_call=4)


@pytest.fixture()
def service():
    service, _ = build_continuous_service(SETTINGS, "/unused", lambda spec, value, labels: None)
    return service


@pytest.fixture(scope="module")
def request_level():
    service, _ = build_service(SETTINGS, "/unused", lambda spec, value, labels: None)
    return service


def incoming(**fields) -> IncomingRequest:
    return IncomingRequest({"prompt": "a red circle", "seed": 5, **fields}, "application/json")


def run(service, arrivals: dict[int, dict[str, IncomingRequest]], limit: int = 200) -> dict[str, list]:
    """Iterate until every request has its final chunk; ``arrivals`` maps iteration -> new requests."""
    chunks, live = {}, []
    for iteration in range(limit):
        new = arrivals.get(iteration, {})
        live += list(new)
        if not live:
            return chunks
        for rid, chunk in service.iterate(new, list(live)).items():
            chunks.setdefault(rid, []).append(chunk)
            if chunk.final:
                live.remove(rid)
    raise AssertionError("requests did not finish")


def png(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.int16)


def alone(request_level, **fields) -> np.ndarray:
    (response,) = request_level.handle_batch([incoming(**fields)])
    return png(response.body)


def test_staggered_requests_with_different_steps_each_get_their_own_image(service, request_level):
    arrivals = {0: {"a": incoming(num_inference_steps=12)}, 3: {"b": incoming(prompt="a blue square", num_inference_steps=4)},
                5: {"c": incoming(prompt="a green triangle", num_inference_steps=6, seed=9)}}
    chunks = run(service, arrivals)
    assert all(len(chunks[rid]) > 1 and chunks[rid][0].status == 200 and chunks[rid][0].content_type == "image/png" for rid in chunks)
    assert all(chunk.body == b"" for rid in chunks for chunk in chunks[rid][:-1])
    assert chunks["a"][0].headers == {"X-Seed": "5"}
    # b (4 steps) joined at iteration 3 and left before a (12 steps) finished
    assert len(chunks["b"]) < len(chunks["a"])
    for rid, fields in {"a": {"num_inference_steps": 12}, "b": {"prompt": "a blue square", "num_inference_steps": 4},
                        "c": {"prompt": "a green triangle", "num_inference_steps": 6, "seed": 9}}.items():
        assert np.abs(png(chunks[rid][-1].body) - alone(request_level, **fields)).max() <= 1


def test_a_streaming_request_gets_progress_events_then_its_image(service, request_level):
    chunks = run(service, {0: {"s": incoming(num_inference_steps=5, stream=True)}})["s"]
    assert chunks[0].content_type == STREAM_CONTENT_TYPE
    events = [json.loads(line) for chunk in chunks for line in chunk.body.decode().splitlines()]
    assert [event["step"] for event in events[:-1]] == [1, 2, 3, 4]
    assert all(event["event"] == "progress" and event["total_steps"] == 5 and event["elapsed_s"] >= 0 for event in events[:-1])
    done = events[-1]
    assert done["event"] == "done" and done["seed"] == 5 and done["parameters"]["num_inference_steps"] == 5
    image = png(base64.b64decode(done["images"][0]))
    assert np.abs(image - alone(request_level, num_inference_steps=5)).max() <= 1


def test_a_bad_request_mid_flight_fails_alone_with_an_ordinary_400(service):
    arrivals = {0: {"good": incoming(num_inference_steps=4)}, 2: {"bad": incoming(num_inference_steps=0)}}
    chunks = run(service, arrivals)
    (bad,) = chunks["bad"]
    assert bad.final and bad.first and bad.status == 400
    assert json.loads(bad.body)["errors"][0]["field"] == "num_inference_steps"
    assert chunks["good"][-1].final and chunks["good"][-1].body.startswith(b"\x89PNG")


def test_stream_is_refused_by_the_request_level_engine(request_level):
    (response,) = request_level.handle_batch([incoming(stream=True)])
    assert response.status == 400 and "continuousBatching: true" in response.body.decode()


def test_a_request_whose_client_left_is_dropped(service):
    service.iterate({"x": incoming(num_inference_steps=10)}, ["x"])
    assert "x" in service.flights
    assert service.iterate({}, []) == {} and service.flights == {}


def test_least_slack_runs_first_within_the_profiles_cap(service):
    now = [0.0]
    service.clock = lambda: now[0]
    shape = (4, 8, 8)
    service.profile.seconds[shape] = {1: 0.1, 2: 0.2, 4: 0.4}  # per-image time flat: cap 1
    assert service.profile.cap(shape) == 1
    service.iterate({"early": incoming(num_inference_steps=10)}, ["early"])
    now[0] = 5.0
    # arrives later but has far more steps: less slack, so it takes the next step alone
    service.iterate({"long": incoming(num_inference_steps=90)}, ["early", "long"])
    early, long = service.flights["early"], service.flights["long"]
    assert service.slack(long, now[0]) < service.slack(early, now[0])
    assert long.job.step == 1 and early.job.step == 1
    service.profile.seconds[shape] = {1: 0.1, 2: 0.1, 4: 0.2}  # batch 2 for the price of 1: cap 2
    assert service.profile.cap(shape) == 2
    service.iterate({}, ["early", "long"])
    assert long.job.step == 2 and early.job.step == 2


def test_metrics_in_flight_iteration_batch_and_deadline_misses():
    recorded = []
    settings = SETTINGS.model_copy(update={"metrics": SETTINGS.metrics.model_copy(update={"latency_sla_seconds": 1e-6})})
    service, _ = build_continuous_service(settings, "/unused", lambda spec, value, labels: recorded.append((spec.name, value)))
    run(service, {0: {"a": incoming(num_inference_steps=3)}, 1: {"b": incoming(num_inference_steps=2, seed=8)}})
    named = {}
    for name, value in recorded:
        named.setdefault(name, []).append(value)
    assert named["sd_in_flight_requests"][:2] == [1, 2] and max(named["sd_in_flight_requests"]) == 2
    assert sum(named["sd_iteration_batch_size"]) == 5  # 3 + 2 image-steps, however they were batched
    assert len(named["sd_denoise_step_seconds"]) == len(named["sd_iteration_batch_size"])
    assert named["sd_deadline_misses_total"] == [1, 1] and named["sd_images_total"] and len(named["sd_request_latency_seconds"]) == 2


def test_out_of_memory_halves_the_step_and_only_a_request_too_large_alone_fails():
    recorded = []
    settings = SETTINGS.model_copy(update={"fault_injection": FaultInjection(out_of_memory_above_pixels=2 * 64 * 64)})
    service, _ = build_continuous_service(settings, "/unused", lambda spec, value, labels: recorded.append(spec.name))
    service.profile.seconds[(4, 8, 8)] = {1: 0.1, 2: 0.1, 4: 0.1}  # the profile allows 4 images per step
    chunks = run(service, {0: {name: incoming(num_inference_steps=3, seed=seed) for seed, name in enumerate("abc")}})
    assert all(chunks[name][-1].body.startswith(b"\x89PNG") for name in "abc")
    assert "sd_oom_retries_total" in recorded and service.profile.cap((4, 8, 8)) == 1
    (too_large,) = run(service, {0: {"big": incoming(num_images_per_prompt=3)}})["big"]
    assert too_large.first and too_large.final and too_large.status == 507


def test_a_failing_step_fails_only_its_requests_after_their_status_was_sent(service, monkeypatch):
    service.profile.seconds[(4, 8, 8)] = {1: 0.1, 2: 0.2}  # cap 1: one request per step
    first = service.iterate({"s": incoming(num_inference_steps=4, stream=True), "n": incoming(num_inference_steps=40)}, ["s", "n"])
    assert first["s"].first and not first["s"].final and first["n"].status == 200
    stepped = next(rid for rid in ("s", "n") if service.flights[rid].job.step == 1)
    waiting = "n" if stepped == "s" else "s"
    real_step = service.stepper.step

    def failing(jobs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(service.stepper, "step", failing)
    chunks = service.iterate({}, ["s", "n"])
    failed = chunks[stepped]
    assert failed.final and not failed.first and stepped not in service.flights
    body = json.loads(failed.body.decode().splitlines()[-1])
    assert "device lost" in body["message"] and (body.get("event") == "error") == (stepped == "s")
    monkeypatch.setattr(service.stepper, "step", real_step)
    while waiting in service.flights:
        chunks = service.iterate({}, [waiting])
    final = chunks[waiting]
    assert final.final
    if waiting == "s":
        assert json.loads(final.body.decode().splitlines()[-1])["event"] == "done"
    else:
        assert final.body.startswith(b"\x89PNG")
