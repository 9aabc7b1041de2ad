"""The OpenAI Images API over the service's two loops (stand-in engine: image k is solid grey
seed + k): routes, the parameter mapping, OpenAI's error shape, server-sent events, and OpenAI
requests sharing forwards with native ones."""

from __future__ import annotations

import base64
import io
import json

import pytest
from PIL import Image

from handler.api.encode import encode_image
from handler.api.openai_images import GENERATIONS, SD_PARAMETERS, SSE_CONTENT_TYPE, ImageEditParams
from handler.api.policy import RequestPolicy
from handler.api.protocol import IncomingRequest
from handler.api.request import GenerationRequest
from handler.api.routes import APIS
from tests.harness.stand_ins import RecordingSink, SolidColorEngine, batch, make_service, run


def openai(path: str = GENERATIONS, **fields) -> IncomingRequest:
    return IncomingRequest(
        {"prompt": "p", "seed": 1, "num_inference_steps": 3, **fields}, "application/json", path=path
    )


def grey(b64: str) -> int:
    return Image.open(io.BytesIO(base64.b64decode(b64))).getpixel((0, 0))[0]


def error_of(response) -> dict:
    payload = json.loads(response.body)
    assert set(payload) == {"error"} and set(payload["error"]) == {"message", "type", "param", "code"}
    return payload["error"]


def events(body: bytes) -> list[tuple[str, dict]]:
    """Server-sent events as (event, data)."""
    parsed = []
    for block in body.decode().split("\n\n"):
        if block:
            event, data = block.split("\n")
            parsed.append((event.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return parsed


def test_generations_answer_the_sdk_images_response_with_each_seed():
    response, native = batch(
        make_service(streaming=False),
        openai(n=2, size="128x64", output_format="jpeg", output_compression=50, quality="hd", style="vivid"),
        IncomingRequest({"prompt": "p", "seed": 9, "num_inference_steps": 3}, "application/json"),
    )
    assert (response.status, response.content_type, response.headers) == (200, "application/json", {"X-Seed": "1"})
    payload = json.loads(response.body)
    assert isinstance(payload["created"], int) and payload["size"] == "128x64" and payload["output_format"] == "jpeg"
    assert [item["seed"] for item in payload["data"]] == [1, 2]
    assert [grey(item["b64_json"]) for item in payload["data"]] == [pytest.approx(1, abs=2), pytest.approx(2, abs=2)]
    image = Image.open(io.BytesIO(base64.b64decode(payload["data"][0]["b64_json"])))
    assert (image.format, image.size) == ("JPEG", (128, 64))
    assert native.content_type == "image/png" and native.headers["X-Seed"] == "9"


def test_every_native_field_is_an_openai_parameter_or_one_of_stable_diffusions_own():
    """A native field the OpenAI bodies neither set from their own parameters nor pass on by name
    would be refused there as unknown."""
    set_by_openai = {"prompt", "num_images_per_prompt", "width", "height", "image", "mask", "strength"}
    set_by_openai |= {"output_format", "output_compression", "partial_images", "response_format", "stream"}
    assert set(SD_PARAMETERS) == set(GenerationRequest.model_fields) - set_by_openai
    assert set_by_openai - {"num_images_per_prompt", "width", "height"} <= set(ImageEditParams.model_fields)


def test_output_compression_is_the_quality_of_lossy_formats():
    noise = Image.effect_noise((64, 64), 64).convert("RGB")
    for output_format in ("jpeg", "webp"):
        sizes = [len(encode_image(noise, output_format, quality=quality)) for quality in (5, 50, 95)]
        assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
    request = APIS[GENERATIONS].decode(openai(output_format="webp", output_compression=50), RequestPolicy())
    assert (request.output_format, request.output_compression) == ("webp", 50)


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"response_format": "url"}, "response_format", "url_unavailable"),
        ({"background": "transparent"}, "background", "transparent_unavailable"),
        ({"model": "dall-e-3"}, "model", "model_not_found"),
        ({"size": "big"}, "size", "size_format"),
        ({"size": "100x64"}, "size", "multiple_of"),
        ({"size": "4096x4096"}, "size", "less_than_equal"),
        ({"n": 99}, "n", "less_than_equal"),
        ({"n": "2"}, "n", "int_type"),
        ({"num_images_per_prompt": 2}, "num_images_per_prompt", "unknown_field"),
        ({"quality": "ultra"}, "quality", "literal_error"),
        ({"output_compression": 101}, "output_compression", "less_than_equal"),
        ({"seed": -1}, "seed", "greater_than_equal"),
        ({"scheduler": "magic"}, "scheduler", "literal_error"),
        ({"prompt": " "}, "prompt", "non_blank"),
        ({"partial_images": 2}, "partial_images", "needs_stream"),
        ({"stream": True}, "stream", "streaming_unavailable"),
        ({"skip_guidance_layers": [7]}, "skip_guidance_layers", "skip_layer_guidance_unavailable"),
        ({"target_size": [64, 64]}, "target_size", "size_conditioning_unavailable"),
    ],
)
def test_a_refusal_is_a_400_in_openai_shape_naming_the_parameter(fields, param, code):
    (response,) = batch(make_service(streaming=False), openai(**fields))
    error = error_of(response)
    assert response.status == 400 and (error["param"], error["code"]) == (param, code)
    assert error["type"] == "invalid_request_error" and error["message"].startswith(f"{param}: ")


def test_bodies_that_are_not_objects_are_refused_as_body():
    for body in (bytearray(b""), bytearray(b"{nope"), ["a list"], "a string"):
        (response,) = batch(make_service(streaming=False), IncomingRequest(body, "application/json", path=GENERATIONS))
        assert response.status == 400 and error_of(response)["param"] is None


def test_a_rejected_openai_field_is_counted_by_its_name_and_unknown_ones_are_not():
    sink = RecordingSink()
    batch(make_service(sink=sink, streaming=False), openai(size="big"), openai(**{"a\nb": 1}))
    labels = {labels[-1] for name, _, labels in sink.records if name == "sd_invalid_requests_total"}
    assert labels == {"size", "unknown_field"}


def test_the_model_list_and_unknown_routes_need_no_generation():
    engine = SolidColorEngine()
    listed, one, other, unknown, native_unknown = batch(
        make_service(engine, streaming=False),
        IncomingRequest(None, path="v1/models"),
        IncomingRequest(None, path="v1/models/stable-diffusion"),
        IncomingRequest(None, path="v1/models/dall-e-3"),
        IncomingRequest(None, path="v1/images/variations"),
        IncomingRequest(None, path="something"),
    )
    assert json.loads(listed.body)["data"][0]["id"] == "stable-diffusion" and listed.status == 200
    assert json.loads(one.body)["object"] == "model"
    assert (other.status, error_of(other)["code"]) == (404, "model_not_found")
    assert (unknown.status, error_of(unknown)["code"]) == (404, "unknown_url")
    assert native_unknown.status == 404 and json.loads(native_unknown.body)["type"] == "NotFound"
    assert engine.steps == []


def test_a_failure_is_in_openai_shape_and_fails_only_its_request():
    bad, good = batch(make_service(streaming=False), openai(prompt="explode at start"), openai(seed=4))
    assert bad.status == 500 and error_of(bad)["type"] == "server_error"
    assert good.status == 200


def test_a_stream_sends_partial_images_then_one_completed_event_per_image():
    parts = run(make_service(), {0: {"s": openai(num_inference_steps=8, stream=True, partial_images=3, n=2, seed=5)}})
    first, *rest = parts["s"]
    assert (first.status, first.content_type, first.headers) == (200, SSE_CONTENT_TYPE, {"X-Seed": "5"})
    sent = events(b"".join(part.body for part in parts["s"]))
    partial = [data for event, data in sent if event == "image_generation.partial_image"]
    completed = [data for event, data in sent if event == "image_generation.completed"]
    assert [(data["partial_image_index"], data["image_index"]) for data in partial] == [
        (index, image) for index in range(3) for image in range(2)
    ]
    assert [(data["seed"], grey(data["b64_json"])) for data in completed] == [(5, 5), (6, 6)]
    assert all(data["type"] == event for event, data in sent) and completed[0]["usage"]["total_tokens"] == 0
    assert rest[-1].final


def test_a_stream_error_before_any_part_is_a_plain_error_and_after_it_an_error_event():
    engine = SolidColorEngine()
    service = make_service(engine)
    (early,) = run(service, {0: {"early": openai(prompt="explode", stream=True)}})["early"]
    assert early.status == 500 and error_of(early)["type"] == "server_error"
    parts, request = [], openai(num_inference_steps=4, stream=True, partial_images=1)
    while not parts or not parts[-1].body:  # until the preview has left, with the status
        parts.append(service.iterate({"late": request})["late"])
        request = IncomingRequest(None)
    engine.broken = True
    failed = service.iterate({"late": request})["late"]
    assert failed.final and not failed.first and parts[-1].status == 200
    ((event, data),) = events(failed.body)
    assert event == "error" and data["error"]["type"] == "server_error"


@pytest.mark.parametrize(
    ("steps", "partial", "expected"), [(8, 3, {2, 4, 6}), (2, 3, {1}), (1, 3, set()), (25, 0, set())]
)
def test_previews_are_evenly_spaced_before_the_last_step(steps, partial, expected):
    request = GenerationRequest.model_construct(num_inference_steps=steps, partial_images=partial)
    assert request.preview_steps(steps) == expected
