"""The OpenAI Images API on a real TorchServe, with the official ``openai`` SDK as the client:
generations (n, sizes, formats, Stable Diffusion's parameters through ``extra_body``, the same
image as the native API for a seed), edits (their parity with diffusers per family is in
``test_families.py``), server-sent events under continuous batching, the model list, every refusal
as the SDK's ``BadRequestError`` naming ``param``, what a bad key gets, and fuzzed bodies of both
endpoints (never a 5xx, never a failed batchmate, the same worker afterwards)."""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import hypothesis.strategies as st
import numpy as np
import openai
import pytest
import requests
from hypothesis import Phase, given, settings
from openai import OpenAI
from PIL import Image

from handler.api.openai_images import SSE_CONTENT_TYPE, ImageEditParams
from server import TorchServe
from tests.harness.images import assert_same_image, decode_png
from tests.harness.serving import Client, worker_processes

FAST = {"num_inference_steps": 4}
EXAMPLES = 30


def sdk(server: TorchServe, api_key: str | None = None) -> OpenAI:
    """The SDK pointed at the server as the README says; no retries, so every answer is seen."""
    return OpenAI(
        base_url=f"{server.predictions_url}/1.0/v1",
        api_key=api_key or server.auth()["Authorization"].removeprefix("Bearer "),
        max_retries=0,
        timeout=300,
    )


def image_of(b64_json: str | None):
    assert b64_json is not None
    return decode_png(base64.b64decode(b64_json))


def test_generations_n_size_and_seed_match_the_native_api(server):
    result = sdk(server).images.generate(
        prompt="a red circle", n=2, size="128x64", response_format="b64_json", extra_body={"seed": 7, **FAST}
    )
    assert result.data is not None and len(result.data) == 2 and result.size == "128x64"
    assert [item.model_extra["seed"] for item in result.data] == [7, 8]
    images = [image_of(item.b64_json) for item in result.data]
    assert images[0].shape == (64, 128, 3)
    native = Client(server).image(prompt="a red circle", seed=8, width=128, height=64)
    assert_same_image(images[1], native)


def test_a_step_cache_through_extra_body_matches_the_native_api(server):
    cache = {"mode": "deep", "interval": 2, "branch": 0}
    result = sdk(server).images.generate(prompt="a red circle", extra_body={"seed": 4, "cache": cache, **FAST})
    assert result.data is not None
    native = Client(server).image(prompt="a red circle", seed=4, cache=cache)
    assert_same_image(image_of(result.data[0].b64_json), native)
    uncached = Client(server).image(prompt="a red circle", seed=4)
    assert not np.array_equal(native, uncached), "the cache changed nothing"


def test_a_custom_schedule_through_extra_body_matches_the_native_api(server):
    schedule = {"scheduler": "euler", "timesteps": [999, 700, 400, 100]}
    result = sdk(server).images.generate(prompt="a red circle", extra_body={"seed": 5, **schedule, **FAST})
    assert result.data is not None
    native = Client(server).image(prompt="a red circle", seed=5, **schedule)
    assert_same_image(image_of(result.data[0].b64_json), native)
    own = Client(server).image(prompt="a red circle", seed=5, scheduler="euler")
    assert not np.array_equal(native, own), "the timesteps changed nothing"


def test_prompt_settings_through_extra_body_match_the_native_api(server):
    settings = {"clip_skip": 1, "guidance_rescale": 0.7}
    result = sdk(server).images.generate(prompt="a red circle", extra_body={"seed": 4, **settings, **FAST})
    assert result.data is not None
    native = Client(server).image(prompt="a red circle", seed=4, **settings)
    assert_same_image(image_of(result.data[0].b64_json), native)
    for name in settings:
        assert not np.array_equal(
            native, Client(server).image(prompt="a red circle", seed=4, **{**settings, name: 0})
        ), f"{name} changed nothing"


@pytest.mark.parametrize(("output_format", "kind"), [("jpeg", "JPEG"), ("webp", "WEBP"), ("png", "PNG")])
def test_output_formats_and_compression(server, output_format, kind):
    result = sdk(server).images.generate(
        prompt="a blue square", output_format=output_format, output_compression=60, extra_body={"seed": 1, **FAST}
    )
    assert result.data is not None and result.output_format == output_format
    data = base64.b64decode(result.data[0].b64_json or "")
    assert Image.open(io.BytesIO(data)).format == kind


def test_parameters_without_meaning_here_are_accepted_and_ignored(server):
    plain = sdk(server).images.generate(prompt="a green star", extra_body={"seed": 3, **FAST})
    decorated = sdk(server).images.generate(
        prompt="a green star",
        quality="high",
        style="natural",
        moderation="low",
        user="someone",
        background="opaque",
        model="stable-diffusion",
        size="auto",
        extra_body={"seed": 3, **FAST},
    )
    assert plain.data and decorated.data
    assert_same_image(image_of(plain.data[0].b64_json), image_of(decorated.data[0].b64_json))


@pytest.mark.parametrize(
    ("arguments", "param"),
    [
        ({"response_format": "url"}, "response_format"),
        ({"background": "transparent"}, "background"),
        ({"model": "dall-e-3"}, "model"),
        ({"size": "1024x"}, "size"),
        ({"size": "100x64"}, "size"),
        ({"n": 50}, "n"),
        ({"output_compression": 150}, "output_compression"),
        ({"extra_body": {"num_inference_steps": 10_000}}, "num_inference_steps"),
        ({"extra_body": {"scheduler": "magic"}}, "scheduler"),
        ({"extra_body": {"width": 64}}, "width"),
        ({"extra_body": {"cache": {"mode": "deep", "interval": 99}}}, "cache"),
        ({"partial_images": 2}, "partial_images"),
        ({"extra_body": {"prompt_2": "a cat"}}, "prompt_2"),  # the default model has one text encoder
    ],
)
def test_a_refusal_is_the_sdk_bad_request_error_naming_the_parameter(server, arguments, param):
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(server).images.generate(prompt="a red circle", **arguments)
    assert caught.value.status_code == 400 and caught.value.param == param
    assert caught.value.type == "invalid_request_error" and param in caught.value.message


def test_streaming_under_continuous_batching_sends_partial_images_then_the_image(continuous_server):
    client = sdk(continuous_server)
    events = list(
        client.images.generate(
            prompt="a red circle", stream=True, partial_images=2, extra_body={"seed": 5, "num_inference_steps": 6}
        )
    )
    assert [event.type for event in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [event.partial_image_index for event in events[:2]] == [0, 1]  # type: ignore[union-attr]
    whole = client.images.generate(prompt="a red circle", extra_body={"seed": 5, "num_inference_steps": 6})
    assert whole.data
    assert_same_image(image_of(events[-1].b64_json), image_of(whole.data[0].b64_json))


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


PICTURE = png(Image.effect_noise((64, 64), 60).convert("RGB"))
MASK = png(Image.new("RGBA", (64, 64), (0, 0, 0, 0)))


def test_an_edit_of_the_default_size_returns_images_of_the_picture_size(server):
    result = sdk(server).images.edit(
        image=("picture.png", png(Image.new("RGB", (128, 64), "red")), "image/png"),
        prompt="a red circle",
        extra_body={"seed": 2, "strength": 0.5, **FAST},
    )
    assert result.data and result.size == "128x64"
    assert image_of(result.data[0].b64_json).shape == (64, 128, 3)


def test_streaming_an_edit_sends_image_edit_events(continuous_server):
    events = list(
        sdk(continuous_server).images.edit(
            image=("picture.png", PICTURE, "image/png"),
            mask=("mask.png", MASK, "image/png"),
            prompt="a red circle",
            stream=True,
            partial_images=1,
            extra_body={"seed": 5, "num_inference_steps": 6},
        )
    )
    assert [event.type for event in events] == ["image_edit.partial_image", "image_edit.completed"]


def bomb() -> bytes:
    """A PNG whose header claims 50000x50000 pixels."""
    header = struct.pack(">IIBBBBB", 50_000, 50_000, 8, 2, 0, 0, 0)
    chunks = b""
    for kind, data in ((b"IHDR", header), (b"IDAT", zlib.compress(b"\0" * 64)), (b"IEND", b"")):
        chunks += struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return b"\x89PNG\r\n\x1a\n" + chunks


@pytest.mark.parametrize(
    ("files", "param", "code"),
    [
        ({"image": ("x.png", b"not an image", "image/png")}, "image", "image_format"),
        ({"image": ("x.png", PICTURE[:-200], "image/png")}, "image", "image_corrupt"),
        ({"image": ("x.png", bomb(), "image/png")}, "image", "image_too_large"),
        ({"image": ("x.png", PICTURE, "image/png"), "mask": ("m.png", PICTURE, "image/png")}, "mask", "mask_alpha"),
        (
            {
                "image": ("x.png", PICTURE, "image/png"),
                "mask": ("m.png", png(Image.new("RGBA", (32, 32))), "image/png"),
            },
            "mask",
            "mask_size",
        ),
    ],
)
def test_a_bad_edit_image_is_the_sdk_bad_request_error_naming_it(server, files, param, code):
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(server).images.edit(prompt="a red circle", **files)
    assert (caught.value.param, caught.value.code) == (param, code)


def test_streaming_under_dynamic_batching_is_a_clear_400(dynamic_server):
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(dynamic_server).images.generate(prompt="a red circle", stream=True)
    assert caught.value.param == "stream" and "continuous" in caught.value.message


def test_the_model_list_names_this_model(server):
    client = sdk(server)
    assert [model.id for model in client.models.list()] == ["stable-diffusion"]
    assert client.models.retrieve("stable-diffusion").owned_by == "torchserve"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("dall-e-3")


def test_a_wrong_key_is_refused_by_torchserve_before_the_handler(server):
    """TorchServe 0.12's token authorization answers 400 (not 401) before any handler runs."""
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(server, api_key="not-the-key").images.generate(prompt="a red circle")
    assert caught.value.status_code == 400 and "Token Authorization failed" in caught.value.message


# Fuzzed bodies: OpenAI's and Stable Diffusion's parameter names (and others) with any JSON value.
NAMES = st.sampled_from([*ImageEditParams.model_fields]) | st.text(min_size=1, max_size=8)
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
BODIES = st.dictionaries(NAMES, VALUES, max_size=5).map(lambda fields: {"prompt": "a red circle", **FAST, **fields})


@pytest.fixture(scope="module")
def workers_before(server) -> list[tuple[str, int, str]]:
    return worker_processes(server)


FORM_VALUES = st.text(max_size=12) | st.integers(-5, 200).map(str) | st.sampled_from(["png", "true", "auto", "64x64"])
EDIT_FORMS = st.builds(
    lambda fields, image, mask: {
        "files": [
            ("prompt", (None, "a red circle")),
            ("num_inference_steps", (None, "4")),
            *((name, (None, value)) for name, value in fields.items()),
            *([("image", ("picture.png", image, "image/png"))] if image is not None else []),
            *([("mask", ("mask.png", mask, "image/png"))] if mask is not None else []),
        ]
    },
    st.dictionaries(NAMES, FORM_VALUES, max_size=4),
    st.sampled_from([PICTURE, PICTURE[:100], b"", None]) | st.binary(max_size=64),
    st.sampled_from([MASK, PICTURE, None]),
)
SENT = st.one_of(
    BODIES.map(lambda body: ("generations", {"data": json.dumps(body, allow_nan=True), "json_body": True})),
    EDIT_FORMS.map(lambda form: ("edits", form)),
)


@settings(max_examples=EXAMPLES, phases=(Phase.explicit, Phase.generate), deadline=None)
@given(sent=SENT)
def test_a_fuzzed_body_gets_images_or_a_400_and_never_fails_its_batchmate(server, workers_before, sent):
    route, arguments = sent[0], dict(sent[1])
    url = f"{server.predictions_url}/1.0/v1/images/{route}"
    headers = server.auth()
    if arguments.pop("json_body", False):
        headers["Content-Type"] = "application/json"
    with ThreadPoolExecutor(2) as pool:
        fuzzed = pool.submit(requests.post, url, headers=headers, timeout=300, **arguments)
        valid = pool.submit(Client(server).predict, {"prompt": "a red circle", "seed": 1, **FAST})
        fuzzed_response, valid_response = fuzzed.result(), valid.result()
    assert valid_response.status_code == 200
    assert fuzzed_response.status_code in (200, 400), fuzzed_response.text[:300]
    if fuzzed_response.headers["Content-Type"] == SSE_CONTENT_TYPE:  # "stream": true
        event = "image_generation" if route == "generations" else "image_edit"
        assert f"event: {event}.completed\ndata: " in fuzzed_response.text
        return
    payload: dict[str, Any] = fuzzed_response.json()
    if fuzzed_response.status_code == 200:
        assert payload["data"] and all(item["b64_json"] for item in payload["data"])
        return
    error = payload["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] in {None, *ImageEditParams.model_fields} or error["code"] == "unknown_field"


def test_the_worker_that_served_the_fuzzing_still_serves(server, workers_before):
    assert worker_processes(server) == workers_before
    result = sdk(server).images.generate(prompt="still here", extra_body=FAST)
    assert result.data and result.data[0].b64_json
