"""End to end through a real TorchServe: images, response modes, seeds, dynamic batching, bad
input, auth, scaling, metrics."""

from __future__ import annotations

import json

import numpy as np
import pytest
import requests

from tests.harness.images import assert_same_image, decode_json_images, decode_png
from tests.harness.serving import FAST, run_behind_blocker, value


def test_png_of_requested_size_with_seed_header(client):
    response = client.predict({"prompt": "a red circle", "width": 128, "height": 64, "seed": 5, **FAST})
    assert response.status_code == 200
    assert response.headers["Content-Type"] == "image/png"
    assert response.headers["X-Seed"] == "5"
    assert decode_png(response.content).shape == (64, 128, 3)


def test_seed_is_reported_when_none_was_sent_and_reproduces_the_image(client):
    response = client.predict({"prompt": "a red circle", **FAST})
    seed = int(response.headers["X-Seed"])
    assert_same_image(decode_png(response.content), client.image(prompt="a red circle", seed=seed))


@pytest.mark.parametrize(
    ("output_format", "content_type", "magic"),
    [
        ("jpeg", "image/jpeg", b"\xff\xd8\xff"),
        ("webp", "image/webp", b"RIFF"),
    ],
)
def test_other_output_formats(client, output_format, content_type, magic):
    response = client.predict({"prompt": "a square", "output_format": output_format, **FAST})
    assert response.status_code == 200
    assert response.headers["Content-Type"] == content_type
    assert response.content.startswith(magic)


def test_json_mode_with_several_images(client):
    body = {"prompt": "a green triangle", "seed": 100, "num_images_per_prompt": 3, "response_format": "json", **FAST}
    response = client.predict(body)
    assert response.status_code == 200 and response.headers["Content-Type"] == "application/json"
    payload = response.json()
    images = decode_json_images(payload)
    assert [image.shape for image in images] == [(64, 64, 3)] * 3
    assert payload["seed"] == 100
    assert payload["parameters"]["num_images_per_prompt"] == 3 and payload["parameters"]["width"] == 64
    assert set(payload["timings"]) == {"admission_s", "denoise_s", "vae_decode_s", "encode_s"}
    assert payload["nsfw_content_detected"] is None  # the default model ships no safety checker
    for offset, image in enumerate(images):
        assert_same_image(image, client.image(prompt="a green triangle", seed=100 + offset))


def test_more_than_one_image_is_json_even_in_image_mode(client):
    response = client.predict({"prompt": "x", "num_images_per_prompt": 2, **FAST})
    assert response.headers["Content-Type"] == "application/json"
    assert len(response.json()["images"]) == 2


def test_text_plain_body_is_the_prompt(client):
    response = client.predict(data=b"a blue square", content_type="text/plain")
    assert response.status_code == 200 and response.headers["Content-Type"] == "image/png"
    seed = int(response.headers["X-Seed"])
    expected = client.predict({"prompt": "a blue square", "seed": seed})
    assert_same_image(decode_png(response.content), decode_png(expected.content))


def test_form_fields(client):
    response = requests.post(
        client.url,
        files={"prompt": (None, "a red circle"), "num_inference_steps": (None, "4"), "seed": (None, "8")},
        headers=client.server.auth(),
        timeout=60,
    )
    assert response.status_code == 200, response.text
    assert_same_image(decode_png(response.content), client.image(prompt="a red circle", seed=8))


def test_same_seed_same_image_different_seed_different_image(client):
    first = client.image(prompt="a yellow circle", seed=7)
    assert np.array_equal(first, client.image(prompt="a yellow circle", seed=7))
    assert np.abs(first.astype(int) - client.image(prompt="a yellow circle", seed=8).astype(int)).mean() > 5


def test_batched_requests_match_alone_and_a_bad_one_fails_alone(dynamic_client):
    good = [
        {"prompt": "a red circle", "seed": 11, "response_format": "json", **FAST},
        {"prompt": "a blue square", "negative_prompt": "red", "seed": 12, "response_format": "json", **FAST},
    ]
    bad = {"prompt": "x", "width": 100, **FAST}
    first, rejected, second = run_behind_blocker(dynamic_client, [good[0], bad, good[1]])
    assert rejected.status_code == 400 and rejected.json()["errors"][0]["field"] == "width"
    for response, body in ((first, good[0]), (second, good[1])):
        assert response.status_code == 200, response.text
        payload = response.json()
        assert payload["batch"] == {"requests": 3, "max_step_images": 2}, "the followers did not share each forward"
        alone = dynamic_client.predict({**body, "response_format": "image"})
        assert_same_image(decode_json_images(payload)[0], decode_png(alone.content))


def test_a_mixed_batch_shares_one_forward_per_shape_whatever_steps_scheduler_and_guidance(dynamic_client):
    bodies = [
        {"prompt": "wide", "width": 128, "height": 64, "response_format": "json", **FAST},
        {"prompt": "square", "response_format": "json", **FAST},
        {"prompt": "square two", "num_images_per_prompt": 2, "response_format": "json", "num_inference_steps": 6},
        {"prompt": "euler", "scheduler": "euler_a", "guidance_scale": 1.0, "response_format": "json", **FAST},
    ]
    responses = run_behind_blocker(dynamic_client, bodies)
    assert [response.status_code for response in responses] == [200] * 4
    payloads = [response.json() for response in responses]
    assert [payload["batch"]["requests"] for payload in payloads] == [4] * 4
    assert payloads[0]["batch"]["max_step_images"] == 1, "the 128x64 request has a latent shape of its own"
    assert [payload["batch"]["max_step_images"] for payload in payloads[1:]] == [4] * 3, (
        "one forward for the 64x64 group"
    )
    assert decode_json_images(payloads[0])[0].shape == (64, 128, 3)
    assert len(payloads[2]["images"]) == 2


def test_missing_or_wrong_token_is_refused(client, server):
    body = json.dumps({"prompt": "x", **FAST})
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {server.keys.management}"}):
        response = requests.post(
            client.url, data=body, headers={"Content-Type": "application/json", **headers}, timeout=30
        )
        assert response.status_code == 400 and "Token Authorization failed" in response.text
    for headers in ({}, {"Authorization": f"Bearer {server.keys.inference}"}):
        assert requests.get(server.model_url, headers=headers, timeout=30).status_code == 400
    assert requests.get(f"{server.addresses.inference}/ping", timeout=30).status_code == 400
    assert requests.get(f"{server.addresses.inference}/ping", headers=server.auth(), timeout=30).status_code == 200


def test_model_api_is_off(server):
    """Registering and unregistering models is refused even with the management key."""
    models = f"{server.addresses.management}/models"
    register = requests.post(
        models, params={"url": "stable-diffusion.mar"}, headers=server.auth(management=True), timeout=30
    )
    unregister = requests.delete(f"{models}/{server.model_name}", headers=server.auth(management=True), timeout=30)
    assert register.status_code == unregister.status_code == 405
    assert len(server.describe()["workers"]) >= 1


def test_scaling_workers_up_and_down_with_dynamic_batching(dynamic_client, dynamic_server):
    """Continuous batching refuses a second worker (tests/integration/test_batching_mode.py)."""
    for count in (2, 1):
        response = dynamic_server.scale(count)
        assert response.status_code == 200, response.text
        workers = dynamic_server.describe()["workers"]
        assert len(workers) == count
        assert all(worker["status"] == "READY" for worker in workers)
        assert dynamic_client.predict({"prompt": f"with {count} workers", **FAST}).status_code == 200


def test_inference_request_counter_grows_with_traffic(client, server):
    before = value(server.metric_samples(), "ts_inference_requests_total", model_version="default")
    for index in range(3):
        assert client.predict({"prompt": f"count me {index}", **FAST}).status_code == 200
    assert value(server.metric_samples(), "ts_inference_requests_total", model_version="default") == before + 3
