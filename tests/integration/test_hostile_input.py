"""Hostile and malformed input through the real server: every case gets its status and a message
naming the problem, and a valid request right after it still succeeds."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.harness.serving import FAST

JSON = "application/json"


def body(**fields) -> bytes:
    return json.dumps({"prompt": "x", **fields}).encode()


# (case, raw body, Content-Type, expected status, field named in the error, words in its message)
CASES = [
    ("truncated JSON", b'{"prompt": "x", "width": 6', JSON, 400, "body", "not valid JSON"),
    ("malformed JSON", b'{"prompt": "x",, }', JSON, 400, "body", "not valid JSON"),
    ("single quotes", b"{'prompt': 'x'}", JSON, 400, "body", "not valid JSON"),
    ("non-UTF-8 JSON", b'{"prompt": "\xff\xfe"}', JSON, 400, "body", "UTF-8"),
    ("non-UTF-8 text", b"\xff\xfe\xfd", "text/plain", 400, "body", "UTF-8"),
    ("empty body", b"", JSON, 400, "body", "empty"),
    ("whitespace body", b"  \n ", JSON, 400, "body", "empty"),
    ("JSON array", b'[{"prompt": "x"}]', JSON, 400, "body", "got a JSON array"),
    ("JSON string", b'"a cat"', JSON, 400, "body", "got a JSON string"),
    ("JSON number", b"42", JSON, 400, "body", "got a JSON number"),
    ("JSON null", b"null", JSON, 400, "body", "JSON null"),
    ("deeply nested JSON", b"[" * 100000 + b"]" * 100000, JSON, 400, "body", "nested too deeply"),
    ("nested object as field", body(extra={"a": [{"b": 1}]}), JSON, 400, "extra", "unknown field"),
    ("wrong Content-Type (XML)", b"<prompt>x</prompt>", "application/xml", 400, "body", "not valid JSON"),
    ("missing prompt", b'{"width": 64}', JSON, 400, "prompt", "Field required"),
    ("empty prompt", body(prompt=""), JSON, 400, "prompt", "non-blank"),
    ("blank prompt", body(prompt=" \t\n"), JSON, 400, "prompt", "non-blank"),
    ("huge prompt", body(prompt="x" * 5000), JSON, 400, "prompt", "max_prompt_chars"),
    ("huge negative prompt", body(negative_prompt="y" * 5000), JSON, 400, "negative_prompt", "max_prompt_chars"),
    ("prompt not a string", body(prompt=["a", "b"]), JSON, 400, "prompt", "valid string"),
    ("NaN guidance", b'{"prompt": "x", "guidance_scale": NaN}', JSON, 400, "guidance_scale", "finite number"),
    ("Infinity guidance", b'{"prompt": "x", "guidance_scale": Infinity}', JSON, 400, "guidance_scale", "finite number"),
    ("negative guidance", body(guidance_scale=-1), JSON, 400, "guidance_scale", "greater than or equal to 0"),
    ("NaN guidance rescale", b'{"prompt": "x", "guidance_rescale": NaN}', JSON, 400, "guidance_rescale", "finite"),
    ("guidance rescale above 1", body(guidance_rescale=1.5), JSON, 400, "guidance_rescale", "less than or equal to 1"),
    ("second prompt on one encoder", body(prompt_2="a cat"), JSON, 400, "prompt_2", "second text encoder"),
    ("third negative prompt", body(negative_prompt_3="blurry"), JSON, 400, "negative_prompt_3", "third text encoder"),
    ("skip-layer guidance on a UNet", body(skip_guidance_layers=[7]), JSON, 400, "skip_guidance_layers", "SD 3.x"),
    ("skip-layer scale on a UNet", body(skip_layer_guidance_scale=2), JSON, 400, "skip_layer_guidance_scale", "SD 3.x"),
    ("SDXL's size on SD 1.x", body(original_size=[1024, 1024]), JSON, 400, "original_size", "conditioning is SDXL's"),
    ("timesteps on DDIM", body(timesteps=[999, 500]), JSON, 400, "timesteps", "takes no custom timesteps"),
    ("rising sigmas", body(scheduler="euler", sigmas=[1, 2, 0]), JSON, 400, "sigmas", "must decrease strictly"),
    ("eta beside Euler", body(scheduler="euler", eta=0.5), JSON, 400, "eta", "acts on DDIM's steps"),
    ("negative clip skip", body(clip_skip=-1), JSON, 400, "clip_skip", "greater than or equal to 0"),
    ("clip skip beyond the encoder", body(clip_skip=12), JSON, 400, "clip_skip", "CLIP text encoders can skip"),
    ("zero steps", body(num_inference_steps=0), JSON, 400, "num_inference_steps", "greater than or equal to 1"),
    ("negative steps", body(num_inference_steps=-5), JSON, 400, "num_inference_steps", "greater than or equal to 1"),
    ("huge steps", body(num_inference_steps=10**12), JSON, 400, "num_inference_steps", "max_inference_steps"),
    ("float steps", body(num_inference_steps=4.5), JSON, 400, "num_inference_steps", "valid integer"),
    ("string steps", body(num_inference_steps="4"), JSON, 400, "num_inference_steps", "valid integer"),
    ("boolean steps", body(num_inference_steps=True), JSON, 400, "num_inference_steps", "valid integer"),
    ("negative seed", body(seed=-1), JSON, 400, "seed", "greater than or equal to 0"),
    ("huge seed", body(seed=10**30), JSON, 400, "seed", "less than or equal to"),
    ("width not a multiple of 8", body(width=100), JSON, 400, "width", "multiple of 8"),
    ("height not a multiple of 8", body(height=70), JSON, 400, "height", "multiple of 8"),
    ("zero width", body(width=0), JSON, 400, "width", "greater than or equal to"),
    ("width beyond max_side", body(width=4096), JSON, 400, "width", "max_side"),
    ("beyond the pixel budget", body(width=1024, height=1032), JSON, 400, "height", "max_pixels"),
    ("too many images", body(num_images_per_prompt=50), JSON, 400, "num_images_per_prompt", "max_images_per_request"),
    ("zero images", body(num_images_per_prompt=0), JSON, 400, "num_images_per_prompt", "greater than or equal to 1"),
    ("unknown scheduler", body(scheduler="lcm"), JSON, 400, "scheduler", "'ddim'"),
    ("unknown output format", body(output_format="gif"), JSON, 400, "output_format", "'png'"),
    ("unknown response format", body(response_format="url"), JSON, 400, "response_format", "'image'"),
    ("unknown field", body(steps=4), JSON, 400, "steps", "allowed fields"),
]


@pytest.mark.parametrize(
    ("case", "data", "content_type", "status", "field", "words"), CASES, ids=[case[0] for case in CASES]
)
def test_hostile_input_is_refused_clearly_and_the_server_still_serves(
    client, case, data, content_type, status, field, words
):
    response = client.predict(data=data, content_type=content_type)
    assert response.status_code == status, response.text
    assert response.headers["Content-Type"] == "application/json"
    payload = response.json()
    assert payload["code"] == status and payload["type"] == "InvalidRequest"
    errors = {error["field"]: error for error in payload["errors"]}
    assert field in errors and errors[field]["rule"], payload
    assert words in errors[field]["message"], errors[field]["message"]
    assert client.predict({"prompt": "still serving", **FAST}).status_code == 200


def test_there_are_at_least_thirty_cases():
    assert len(CASES) >= 30


def test_a_body_over_max_request_size_gets_413_and_the_server_still_serves(client, server, tmp_path):
    limit = int((server.workdir / "config.properties").read_text().split("max_request_size=")[1].split()[0])
    oversized = tmp_path / "body.json"
    oversized.write_text(json.dumps({"prompt": "x" * (limit + 1)}))
    result = subprocess.run(
        [
            "curl",
            "-sS",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "-X",
            "POST",
            client.url,
            "-H",
            f"Authorization: Bearer {server.keys.inference}",
            "-H",
            "Content-Type: application/json",
            "--data-binary",
            f"@{oversized}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.stdout == "413", result.stdout + result.stderr
    assert client.predict({"prompt": "still serving", **FAST}).status_code == 200


# Malformed form bodies that TorchServe's frontend (netty's form decoder) refuses itself, before
# any worker: it answers 500 ErrorDataDecoderException, which the handler cannot change.
FRONTEND_FORM_ERRORS = [
    (
        "multipart part with a charset Java does not know",
        {"files": [("prompt", (None, b"x")), ("x", ("f", b"v", "text/plain; charset=latin-1"))]},
    ),
    ("multipart boundary without a value", {"data": b"--x\r\n", "content_type": "multipart/form-data; boundary"}),
    (
        "bad %-escape in a urlencoded body",
        {"data": b"prompt=a%zzred", "content_type": "application/x-www-form-urlencoded"},
    ),
]


@pytest.mark.parametrize(("case", "sent"), FRONTEND_FORM_ERRORS, ids=[case for case, _ in FRONTEND_FORM_ERRORS])
def test_a_malformed_form_body_gets_torchserves_own_500_and_the_server_still_serves(client, case, sent):
    """A known limit of TorchServe 0.12 (docs/reliability.md): pinned so a change in it shows."""
    response = client.predict(**{"content_type": None, **sent})
    assert response.status_code == 500 and response.json()["type"] == "ErrorDataDecoderException", response.text
    assert client.predict({"prompt": "still serving", **FAST}).status_code == 200
