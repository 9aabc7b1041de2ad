"""The README's examples, run as written against a real TorchServe: only the loopback ports are
the test server's, and ``runtime/key_file.json`` is that server's key file."""

from __future__ import annotations

import json

import numpy as np
import pytest
import requests

from model_making.shapes import coloured_mask, dominant_colour
from server import KEY_FILE, Keys
from tests.harness.images import decode_png
from tests.harness.readme import RUNNERS, readme_examples, run_example


def test_every_marked_example_is_bash_or_python():
    examples = readme_examples()
    assert {
        "json-curl",
        "prompt-as-body",
        "python-requests",
        "rotate-key",
        "grpc-cli",
        "grpc-python",
        "openai-sdk",
        "openai-curl",
        "lora-curl",
        "controlnet-python",
        "sd3-curl",
        "schedule-curl",
    } <= set(examples)
    assert all(language in RUNNERS for language, _ in examples.values())


@pytest.mark.parametrize("name", ["json-curl", "prompt-as-body", "python-requests", "schedule-curl"])
def test_a_readme_request_example_saves_a_png_of_the_default_size(name, server, cwd):
    result = run_example(name, server, cwd)
    assert decode_png((cwd / "image.png").read_bytes()).shape == (64, 64, 3)
    if name == "python-requests":
        assert result.stdout.startswith("image/png seed ")


@pytest.mark.parametrize("name", ["openai-sdk", "openai-curl"])
def test_a_readme_openai_example_generates_and_edits(name, server, cwd):
    result = run_example(name, server, cwd)
    made = ["circle-0.png", "circle-1.png", "edited.png"] if name == "openai-sdk" else ["image.png", "edited.png"]
    for file in made:
        assert decode_png((cwd / file).read_bytes()).shape == (64, 64, 3)
    if name == "openai-curl":
        assert json.loads(result.stdout.splitlines()[0])["data"][0]["id"] == "stable-diffusion"


def test_the_readme_lora_example_draws_the_default_model_an_outline(server, cwd):
    run_example("lora-curl", server, cwd)
    assert decode_png((cwd / "outline.png").read_bytes()).shape == (64, 64, 3)


def test_the_readme_controlnet_example_draws_the_circle_where_the_mask_says(server, cwd):
    run_example("controlnet-python", server, cwd)
    image = decode_png((cwd / "controlled.png").read_bytes())
    mask = np.zeros((64, 64), dtype=bool)  # the example's circle, lower left
    rows, cols = np.ogrid[:64, :64]
    mask[(rows - 42) ** 2 + (cols - 18) ** 2 <= 12**2] = True
    drawn = coloured_mask(image)
    assert dominant_colour(image) == "blue"
    assert (drawn & mask).sum() / (drawn | mask).sum() > 0.6, "the circle is not where the mask says"


def test_the_readme_key_rotation_replaces_the_inference_key(server, cwd):
    url = server.predictions_url
    old = server.keys
    run_example("rotate-key", server, cwd)
    server.keys = Keys.from_key_file(server.workdir / KEY_FILE)  # the session's other tests use the new key
    assert server.keys.inference != old.inference and server.keys.management == old.management
    body = json.dumps({"prompt": "a red circle", "num_inference_steps": 2})
    headers = {"Content-Type": "application/json"}
    refused = requests.post(url, data=body, headers={**headers, "Authorization": f"Bearer {old.inference}"}, timeout=60)
    assert refused.status_code == 400 and "Token Authorization failed" in refused.text
    assert requests.post(url, data=body, headers={**headers, **server.auth()}, timeout=120).status_code == 200
