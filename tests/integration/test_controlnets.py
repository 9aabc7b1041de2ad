"""ControlNets on the shipped server with the default model and the checkout's ``controlnets/``
(``shapes-mask``): the ControlNet is listed with the model; the OpenAI SDK's ``extra_body`` and a
multipart form with the control image as a file part get the JSON API's image; Canny in the server
equals OpenCV's edge map sent as the image; a ControlNet directory added while the server runs is
served at once, and so is the same ControlNet as an A1111 single file (LDM keys), equal to its
directory, while a truncated file and a file of no ControlNet are 400s naming ``controlnets`` that
disturb no batchmate. Parity with diffusers per family and mode, hostile input and the metrics are in
``test_families.py``; the README's example in ``test_readme_examples.py``."""

from __future__ import annotations

import base64
import io
import shutil
from concurrent.futures import ThreadPoolExecutor

import cv2
import numpy as np
import requests
from openai import OpenAI
from PIL import Image, ImageDraw

from model_making.single_file import write_controlnet_file
from tests.harness.images import assert_same_image, decode_png
from tests.harness.serving import Client, worker_processes

BASE = {"prompt": "a green square", "seed": 4, "num_inference_steps": 4}


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def mask() -> Image.Image:
    image = Image.new("RGB", (64, 64))
    ImageDraw.Draw(image).rectangle((30, 8, 56, 34), fill="white")
    return image


def photo() -> np.ndarray:
    """A picture with edges: a yellow triangle on grey."""
    image = Image.new("RGB", (64, 64), (90, 90, 90))
    ImageDraw.Draw(image).polygon([(32, 6), (58, 56), (6, 56)], fill=(240, 210, 20))
    return np.asarray(image)


def control(image: bytes, **settings) -> dict:
    return {"name": "shapes-mask", "image": base64.b64encode(image).decode(), **settings}


def test_the_model_list_names_the_controlnets(server):
    response = requests.get(f"{server.predictions_url}/1.0/v1/models", headers=server.auth(), timeout=30)
    (model,) = response.json()["data"]
    assert [item["name"] for item in model["controlnets"]] == ["shapes-mask"]
    assert [item["name"] for item in model["loras"]] == ["outline"]


def test_the_sdk_and_a_form_get_the_json_apis_image(server):
    native = Client(server).image(**BASE, controlnets=[control(png(mask()), scale=0.8)])
    sdk = OpenAI(base_url=f"{server.predictions_url}/1.0/v1", api_key=server.keys.inference, max_retries=0)
    result = sdk.images.generate(
        prompt=BASE["prompt"],
        extra_body={"seed": 4, "num_inference_steps": 4, "controlnets": [control(png(mask()), scale=0.8)]},
    )
    assert result.data is not None
    assert_same_image(decode_png(base64.b64decode(result.data[0].b64_json or "")), native)
    form = requests.post(
        server.predictions_url,
        headers=server.auth(),
        files={
            "prompt": (None, BASE["prompt"]),
            "seed": (None, "4"),
            "num_inference_steps": (None, "4"),
            "controlnets": (None, '[{"name": "shapes-mask", "scale": 0.8}]'),
            "controlnets.0.image": ("mask.png", png(mask()), "image/png"),
        },
        timeout=120,
    )
    assert form.status_code == 200, form.text
    assert_same_image(decode_png(form.content), native)
    plain = Client(server).image(**BASE)
    assert np.abs(plain.astype(int) - native.astype(int)).max() > 30, "the ControlNet moved the square"


def test_canny_in_the_server_equals_opencvs_edge_map_sent_as_the_image(server):
    edges = cv2.Canny(photo(), 100, 200)
    sent = Client(server).image(**BASE, controlnets=[control(png(Image.fromarray(np.stack([edges] * 3, axis=2))))])
    made = Client(server).image(**BASE, controlnets=[control(png(Image.fromarray(photo())), preprocess="canny")])
    assert_same_image(made, sent)


def test_a_controlnet_added_while_the_server_runs_is_served_at_once(server, served_dirs):
    added = served_dirs.controlnets / "added-while-serving"
    shutil.copytree(served_dirs.controlnets / "shapes-mask", added)
    try:
        body = {**BASE, "controlnets": [{**control(png(mask())), "name": added.name}]}
        assert_same_image(
            Client(server).image(**body), Client(server).image(**BASE, controlnets=[control(png(mask()))])
        )
    finally:
        shutil.rmtree(added)
    response = Client(server).predict({**BASE, "controlnets": [{**control(png(mask())), "name": added.name}]})
    assert response.status_code == 400 and response.json()["errors"][0]["rule"] == "unknown_controlnet"


def test_a_single_file_controlnet_equals_its_directory_and_broken_files_are_refused(server, served_dirs):
    directory = served_dirs.controlnets
    single = write_controlnet_file(directory / "shapes-mask", directory / "shapes-mask-a1111.safetensors")
    truncated = directory / "truncated.safetensors"
    truncated.write_bytes(single.read_bytes()[: single.stat().st_size // 2])
    not_a_controlnet = directory / "a-lora.safetensors"
    shutil.copy(served_dirs.loras / "outline.safetensors", not_a_controlnet)
    try:
        from_file = Client(server).image(**BASE, controlnets=[{**control(png(mask())), "name": single.stem}])
        assert_same_image(from_file, Client(server).image(**BASE, controlnets=[control(png(mask()))]))
        before = worker_processes(server)
        for broken, says in ((truncated, "truncated"), (not_a_controlnet, "not a ControlNet")):
            with ThreadPoolExecutor(2) as pool:
                refused = pool.submit(
                    Client(server).predict, {**BASE, "controlnets": [{**control(png(mask())), "name": broken.stem}]}
                )
                batchmate = pool.submit(Client(server).predict, {**BASE, "controlnets": [control(png(mask()))]})
                assert batchmate.result().status_code == 200
            assert refused.result().status_code == 400, refused.result().text
            (error,) = refused.result().json()["errors"]
            assert error["field"].startswith("controlnets") and error["rule"] == "controlnet_unloadable", error
            assert broken.stem in error["message"] and says in error["message"], error
        assert worker_processes(server) == before
    finally:
        for path in (single, truncated, not_a_controlnet):
            path.unlink()
