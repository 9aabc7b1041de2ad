"""LoRA adapters per request on a real TorchServe serving the default model, in both batching
modes: equal to diffusers' pipeline with ``load_lora_weights`` + ``set_adapters``, several per
request with their own scales; requests with other LoRA sets (or none, attention, convolution and
feed-forward LoRAs) sharing denoiser forwards, each equal to itself alone, while adapters are
evicted; LyCORIS LoHa and LoKr files beside a plain LoRA, equal to their deltas merged into the
weights; a file added or changed while the server runs; every hostile name, file and scale refused
naming ``loras`` without disturbing a batchmate or the worker; the metrics; the OpenAI API's
``extra_body``. Parity on every family is in ``test_families.py``."""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests
import torch
from openai import OpenAI

from bench.reference import Reference
from model_making.make_lora import write_lora, write_lycoris
from server import TorchServe, write_model_config
from server.paths import DEFAULT_MODEL_DIR, ROOT, TINY_MODEL_DIRS
from tests.harness.images import assert_same_image, decode_png
from tests.harness.serving import FAST, Client, serving, settled_samples, value, worker_processes

MODES = ("dynamic", "continuous")
SHIPPED_LORA = ROOT / "loras" / "outline.safetensors"
BASE = {"prompt": "a red circle outline", "seed": 3, "num_inference_steps": 6}
LONG = {"prompt": "keep the worker busy", "seed": 1, "num_inference_steps": 100}


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory) -> Path:
    """The shipped outline LoRA, random ones for the default model (one without text encoder
    layers), a LoHa and a LoKr, and files that must be refused: corrupt, a pickle, another family's,
    a weight-decomposed LoHa."""
    directory = tmp_path_factory.mktemp("loras")
    shutil.copy(SHIPPED_LORA, directory / "outline.safetensors")
    write_lora(DEFAULT_MODEL_DIR, directory / "random.safetensors", seed=1)
    write_lora(DEFAULT_MODEL_DIR, directory / "unet-only.safetensors", seed=2, text_encoder=False)
    write_lora(
        DEFAULT_MODEL_DIR,
        directory / "conv-ff.safetensors",
        seed=4,
        text_encoder=False,
        layers=("conv", "feed_forward"),
        spread=0.1,
    )
    write_lora(TINY_MODEL_DIRS["sdxl"], directory / "sdxl.safetensors", seed=3)
    write_lycoris(DEFAULT_MODEL_DIR, directory / "loha.safetensors", "loha", seed=5, dim=4, alpha=2.0, spread=0.2)
    write_lycoris(DEFAULT_MODEL_DIR, directory / "lokr.safetensors", "lokr", seed=6, dim=4, factor=4, spread=0.2)
    write_lycoris(DEFAULT_MODEL_DIR, directory / "loha-dora.safetensors", "loha", seed=7, dora_wd=True)
    (directory / "corrupt.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    torch.save({"lora_A": torch.zeros(2)}, directory / "pickled.safetensors")
    return directory


@pytest.fixture(scope="module", params=MODES)
def served(request, tmp_path_factory, lora_dir) -> Iterator[TorchServe]:
    tmp = tmp_path_factory.mktemp(f"lora-{request.param}")
    config = write_model_config(
        tmp,
        handler={"loras": {"dir": str(lora_dir), "max_loaded": 2}},
        continuousBatching=request.param == "continuous",
    )
    with serving(tmp, config) as server:
        yield server


@pytest.fixture(scope="module")
def reference() -> Reference:
    return Reference(DEFAULT_MODEL_DIR)


def image(server: TorchServe, **fields) -> np.ndarray:
    return Client(server).image(**{**BASE, **fields})


def reference_image(reference: Reference, **options) -> np.ndarray:
    """diffusers' image of ``BASE`` at 64x64 with ``options`` (``loras``, ``lycoris``)."""
    steps = BASE["num_inference_steps"]
    return np.asarray(reference(BASE["prompt"], BASE["seed"], 64, 64, steps, **options).images[0])


def test_several_loras_with_their_scales_equal_diffusers(served, reference, lora_dir):
    loras = [{"name": "random", "scale": 0.8}, {"name": "unet-only", "scale": -0.5}]
    ours = image(served, loras=loras)
    files = [(lora_dir / "random.safetensors", 0.8), (lora_dir / "unet-only.safetensors", -0.5)]
    assert_same_image(ours, reference_image(reference, loras=files))
    assert np.abs(ours.astype(int) - image(served).astype(int)).max() > 10, "the LoRAs changed the image"


def test_loha_and_lokr_beside_a_lora_equal_their_deltas_merged(served, reference, lora_dir):
    loras = [{"name": "loha", "scale": 0.8}, {"name": "lokr", "scale": 0.6}, {"name": "random", "scale": 0.5}]
    ours = image(served, loras=loras)
    lycoris = [(lora_dir / "loha.safetensors", 0.8), (lora_dir / "lokr.safetensors", 0.6)]
    theirs = reference_image(reference, loras=[(lora_dir / "random.safetensors", 0.5)], lycoris=lycoris)
    assert_same_image(ours, theirs)
    without = image(served, loras=[{"name": "random", "scale": 0.5}])
    assert np.abs(ours.astype(int) - without.astype(int)).max() > 10, "the LoHa and LoKr changed the image"


def test_requests_with_other_lora_sets_share_forwards_and_each_equals_itself_alone(served):
    """Five sets of four LoRAs in flight with a server keeping two: adapters not in use are evicted
    as others load, and those in use stay."""
    bodies = [
        {**BASE, "response_format": "json"},
        {**BASE, "loras": [{"name": "random", "scale": 0.8}], "response_format": "json"},
        {**BASE, "loras": [{"name": "random", "scale": 0.3}, {"name": "conv-ff"}], "response_format": "json"},
        {**BASE, "loras": [{"name": "outline"}], "response_format": "json"},
        {**BASE, "loras": [{"name": "unet-only", "scale": -0.5}], "response_format": "json"},
    ]
    client = Client(served)
    before = served.metric_samples()
    with ThreadPoolExecutor(len(bodies) + 1) as pool:
        long = pool.submit(client.predict, {**LONG, "loras": [{"name": "conv-ff", "scale": 0.5}]})
        together = [pool.submit(client.predict, body) for body in bodies]
        assert long.result().status_code == 200
        answers = [future.result() for future in together]
    after = served.metric_samples()
    forwards = value(after, "sd_iteration_lora_adapters_count") - value(before, "sd_iteration_lora_adapters_count")
    at_most_one = value(after, "sd_iteration_lora_adapters_bucket", le="1.0") - value(
        before, "sd_iteration_lora_adapters_bucket", le="1.0"
    )
    assert forwards - at_most_one >= BASE["num_inference_steps"], "forwards with several adapters in them"
    for body, answer in zip(bodies, answers, strict=True):
        assert answer.status_code == 200, answer.text
        (batched,) = [decode_png(base64.b64decode(item)) for item in answer.json()["images"]]
        alone = image(served, **{key: value for key, value in body.items() if key != "response_format"})
        assert_same_image(batched, alone)


def test_a_lora_added_or_changed_while_serving_is_used_at_the_next_request(served, lora_dir):
    client = Client(served)
    listed = requests.get(f"{served.predictions_url}/1.0/v1/models", headers=served.auth(), timeout=60).json()
    assert {"outline", "random"} <= {lora["name"] for lora in listed["data"][0]["loras"]}
    name = f"fresh-{served.describe()['workers'][0]['pid']}"
    refused = client.predict({**BASE, "loras": [{"name": name}]})
    assert refused.status_code == 400 and refused.json()["errors"][0]["rule"] == "unknown_lora"
    shutil.copy(lora_dir / "random.safetensors", lora_dir / f"{name}.safetensors")
    assert_same_image(image(served, loras=[{"name": name}]), image(served, loras=[{"name": "random"}]))
    shutil.copy(lora_dir / "unet-only.safetensors", lora_dir / f"{name}.safetensors")
    assert_same_image(image(served, loras=[{"name": name}]), image(served, loras=[{"name": "unet-only"}]))


@pytest.mark.parametrize(
    ("loras", "rule"),
    [
        ([{"name": "../outline"}], "lora_name"),
        ([{"name": "/etc/passwd"}], "lora_name"),
        ([{"name": "sub/outline"}], "lora_name"),
        ([{"name": "nope"}], "unknown_lora"),
        ([{"name": "corrupt"}], "lora_unloadable"),
        ([{"name": "pickled"}], "lora_unloadable"),
        ([{"name": "sdxl"}], "lora_unloadable"),
        ([{"name": "loha-dora"}], "lora_unloadable"),
        ([{"name": "outline", "scale": 1e6}], "lora_scale"),
        ([{"name": "outline", "scale": "NaN"}], "float_type"),
    ],
)
def test_a_hostile_lora_is_a_400_naming_loras_and_disturbs_no_batchmate(served, loras, rule):
    before = worker_processes(served)
    client = Client(served)
    data = json.dumps({**BASE, "loras": loras}).replace('"NaN"', "NaN").encode()
    with ThreadPoolExecutor(2) as pool:
        hostile = pool.submit(client.predict, data=data)
        batchmate = pool.submit(client.predict, {**BASE, "loras": [{"name": "outline"}]})
        refused, served_fine = hostile.result(), batchmate.result()
    assert refused.status_code == 400, refused.text
    (error,) = refused.json()["errors"]
    assert error["field"].startswith("loras") and error["rule"] in (rule, "finite_number"), error
    assert served_fine.status_code == 200 and worker_processes(served) == before


def test_the_loaded_adapters_stay_bounded_and_requests_are_counted_by_lora(served):
    before = settled_samples(Client(served))
    for name in ("outline", "random", "unet-only", "outline"):
        assert Client(served).predict({**BASE, **FAST, "loras": [{"name": name}]}).status_code == 200
    after = settled_samples(Client(served))
    counted = value(after, "sd_lora_requests_total", lora="outline") - value(
        before, "sd_lora_requests_total", lora="outline"
    )
    assert counted == 2
    loaded = [v for (name, _), v in after.items() if name == "sd_loras_loaded"]
    assert loaded and max(loaded) <= 2


def test_the_openai_api_takes_loras_in_extra_body(served):
    client = OpenAI(base_url=f"{served.predictions_url}/1.0/v1", api_key=served.keys.inference, max_retries=0)
    result = client.images.generate(
        prompt=BASE["prompt"],
        extra_body={
            "seed": BASE["seed"],
            "num_inference_steps": BASE["num_inference_steps"],
            "loras": [{"name": "outline"}],
        },
    )
    assert result.data and result.data[0].b64_json
    assert_same_image(decode_png(base64.b64decode(result.data[0].b64_json)), image(served, loras=[{"name": "outline"}]))
