"""The batch flow with a stand-in engine: one response per request, failures stay with their request."""

from __future__ import annotations

import io
import json

import pytest
import torch
from PIL import Image

from handler.batching import CallInputs, CallKey
from handler.metrics import CallTimings, DiffusionMetrics, MetricSpec
from handler.request import RequestPolicy
from handler.service import IncomingRequest, TextToImageService


class SolidColorEngine:
    """Paints each image a grey level equal to its seed; fails calls whose prompts ask for it."""

    def __init__(self):
        self.calls: list[tuple[CallKey, CallInputs]] = []

    def generate(self, key: CallKey, inputs: CallInputs) -> list[Image.Image]:
        self.calls.append((key, inputs))
        if "explode" in inputs.prompts:
            raise RuntimeError("boom")
        if "oom" in inputs.prompts or ("oom if batched" in inputs.prompts and len(inputs.seeds) > 1):
            raise torch.OutOfMemoryError("CUDA out of memory")
        images = [Image.new("RGB", (key.width, key.height), (seed % 256,) * 3) for seed in inputs.seeds]
        return images, CallTimings(denoise_steps=[0.01] * key.num_inference_steps, vae_decode=0.02)


@pytest.fixture
def engine() -> SolidColorEngine:
    return SolidColorEngine()


class RecordingSink:
    def __init__(self) -> None:
        self.records: list[tuple[str, float, tuple[str, ...]]] = []

    def __call__(self, spec: MetricSpec, value: float, labels: tuple[str, ...]) -> None:
        self.records.append((spec.name, value, labels))

    def values(self, name: str) -> list[float]:
        return [value for recorded, value, _ in self.records if recorded == name]


@pytest.fixture
def sink() -> RecordingSink:
    return RecordingSink()


@pytest.fixture
def service(engine, sink) -> TextToImageService:
    return TextToImageService(engine, RequestPolicy(), 8, DiffusionMetrics(sink, latency_sla_seconds=2.0))


def body(**fields) -> IncomingRequest:
    return IncomingRequest({"prompt": "p", "seed": 1, "width": 64, "height": 64, **fields}, "application/json")


def grey_level(data: bytes) -> int:
    return Image.open(io.BytesIO(data)).getpixel((0, 0))[0]


def test_each_request_gets_its_own_images_from_one_call(service, engine):
    responses = service.handle_batch([body(seed=10), body(seed=20, num_images_per_prompt=2, response_format="json"), body(seed=30)])
    assert len(engine.calls) == 1 and engine.calls[0][1].seeds == [10, 20, 21, 30]
    assert [response.status for response in responses] == [200, 200, 200]
    assert grey_level(responses[0].body) == 10 and grey_level(responses[2].body) == 30
    payload = json.loads(responses[1].body)
    assert payload["seed"] == 20 and payload["batch"] == {"requests": 3, "call_images": 4}
    assert responses[1].headers == {"X-Seed": "20"} and responses[1].content_type == "application/json"


def test_a_bad_request_fails_alone(service):
    responses = service.handle_batch([body(seed=5), body(width=100), IncomingRequest(bytearray(b"{"), "application/json")])
    assert [response.status for response in responses] == [200, 400, 400]
    assert json.loads(responses[1].body)["errors"][0]["field"] == "width"
    assert grey_level(responses[0].body) == 5


def test_a_failing_call_fails_only_its_members(service, engine):
    responses = service.handle_batch([body(prompt="explode"), body(width=128, seed=7), body(seed=8)])
    assert len(engine.calls) == 2
    assert [response.status for response in responses] == [500, 200, 500]
    assert "RuntimeError: boom" in json.loads(responses[0].body)["message"]
    assert grey_level(responses[1].body) == 7


def test_out_of_memory_is_507(service):
    (response,) = service.handle_batch([body(prompt="oom")])
    assert response.status == 507 and json.loads(response.body)["type"] == "OutOfMemory"


def test_an_unexpected_decoding_error_fails_only_that_request(service, monkeypatch):
    import handler.service

    real_decode_body = handler.service.decode_body

    def buggy_decode_body(body, content_type, policy):
        if body.get("prompt") == "bug":
            raise TypeError("unexpected")
        return real_decode_body(body, content_type, policy)

    monkeypatch.setattr(handler.service, "decode_body", buggy_decode_body)
    responses = service.handle_batch([body(seed=3), body(prompt="bug")])
    assert [response.status for response in responses] == [200, 500]
    assert "decoding failed: TypeError" in json.loads(responses[1].body)["message"]


def test_fields_in_both_body_and_form_are_refused(service):
    (response,) = service.handle_batch([IncomingRequest({"prompt": "x"}, "application/json", {"seed": "1"})])
    assert response.status == 400 and json.loads(response.body)["errors"][0]["rule"] == "one_source"


def test_form_fields_without_body(service):
    (response,) = service.handle_batch([IncomingRequest(None, None, {"prompt": "x", "seed": "9", "width": "64", "height": "64"})])
    assert response.status == 200 and response.headers["X-Seed"] == "9"


def test_out_of_memory_splits_the_call_until_it_fits(service, engine, sink):
    responses = service.handle_batch([body(seed=1), body(prompt="oom if batched", seed=2), body(seed=3)])
    assert [response.status for response in responses] == [200, 200, 200]
    assert [len(inputs.seeds) for _, inputs in engine.calls] == [3, 1, 2, 1, 1]
    assert sink.values("sd_oom_retries_total") == [1, 1]
    assert [grey_level(response.body) for response in responses] == [1, 2, 3]


def test_only_the_request_that_cannot_fit_alone_fails(service, sink):
    responses = service.handle_batch([body(seed=1), body(prompt="oom", seed=2)])
    assert [response.status for response in responses] == [200, 507]


def test_metrics_follow_the_batch(service, sink):
    service.handle_batch([body(num_inference_steps=3), body(num_inference_steps=3, num_images_per_prompt=2), body(prompt="", width=100)])
    assert sink.values("sd_batch_size") == [3]
    assert sink.values("sd_pipeline_calls_total") == [1] and sink.values("sd_images_total") == [3]
    assert sink.values("sd_denoise_step_seconds") == [0.01] * 3 and sink.values("sd_vae_decode_seconds") == [0.02]
    assert sorted(labels for name, _, labels in sink.records if name == "sd_invalid_requests_total") == [("prompt",), ("width",)]
    latencies = sink.values("sd_request_latency_seconds")
    assert len(latencies) == 2 and all(latency > 0 for latency in latencies)
    assert sink.values("sd_request_latency_sla_ratio") == [latency / 2.0 for latency in latencies]
    assert len(sink.values("sd_encode_seconds")) == 2 and sink.values("sd_latency_sla_seconds") == [2.0]


def test_prompts_are_logged_only_when_configured(engine, sink, caplog):
    import logging

    quiet = TextToImageService(engine, RequestPolicy(), 8, DiffusionMetrics(sink, 2.0))
    chatty = TextToImageService(engine, RequestPolicy(), 8, DiffusionMetrics(sink, 2.0), log_prompts=True)
    with caplog.at_level(logging.DEBUG, logger="handler.service"):
        quiet.handle_batch([body(prompt="private words"), body(prompt="rejected words", width=100)])
    assert "private words" not in caplog.text and "rejected words" not in caplog.text
    assert "width (multiple_of)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="handler.service"):
        chatty.handle_batch([body(prompt="shared words")])
    assert "shared words" in caplog.text


def test_the_507_message_says_what_does_not_fit(service):
    (response,) = service.handle_batch([body(prompt="oom", width=128, height=64, num_images_per_prompt=2)])
    message = json.loads(response.body)["message"]
    assert response.status == 507 and "2 image(s) of 128x64 even alone" in message
