"""A real TorchServe on loopback serving the real archive, built from the default (trained) model."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import requests
from PIL import Image

from scripts.build_mar import DEFAULT_MODEL_DIR
from scripts.server import TorchServe, serve_archive

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = DEFAULT_MODEL_DIR
STARTUP_TIMEOUT = 600


@contextmanager
def serving(tmp: Path, model_config: Path = ROOT / "model-config.yaml", **properties: str) -> Iterator[TorchServe]:
    """The real archive, built from ``model_config``, served on free loopback ports (config.properties
    plus ``properties``) until the block ends."""
    if not (MODEL_DIR / "model_index.json").is_file():
        pytest.fail(f"{MODEL_DIR} is missing: it is committed; `make train-default-model` rebuilds it")
    with serve_archive(MODEL_DIR, model_config, tmp, STARTUP_TIMEOUT, **properties) as server:
        yield server


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Iterator[TorchServe]:
    with serving(tmp_path_factory.mktemp("torchserve")) as instance:
        yield instance


class Client:
    """Small HTTP helper bound to one server and its keys."""

    def __init__(self, server: TorchServe):
        self.server = server
        self.url = f"{server.addresses.inference}/predictions/{server.model_name}"

    def predict(self, body=None, *, data=None, content_type="application/json", headers=None, **kwargs) -> requests.Response:
        all_headers = {**self.server.auth(), **({"Content-Type": content_type} if content_type else {}), **(headers or {})}
        if body is not None:
            return requests.post(self.url, json=body, headers=all_headers, timeout=120, **kwargs)
        return requests.post(self.url, data=data, headers=all_headers, timeout=120, **kwargs)

    def image(self, **fields) -> np.ndarray:
        """One image as an array, asserting success."""
        response = self.predict({"num_inference_steps": 4, **fields})
        assert response.status_code == 200, response.text
        return decode_png(response.content)


@pytest.fixture(scope="session")
def client(server) -> Client:
    return Client(server)


def value(samples, name: str, **labels) -> float:
    return samples.get((name, frozenset({"model_name": "stable-diffusion", **labels}.items())), 0.0)


def decode_png(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def decode_json_images(payload: dict) -> list[np.ndarray]:
    return [decode_png(base64.b64decode(item)) for item in payload["images"]]


def assert_same_image(first: np.ndarray, second: np.ndarray) -> None:
    """Equal up to float rounding across batch sizes: at most 1 level on at most 1% of values."""
    difference = np.abs(first.astype(int) - second.astype(int))
    assert difference.max() <= 1, f"max difference {difference.max()}"
    assert (difference > 0).mean() <= 0.01, f"{(difference > 0).mean():.2%} of values differ"
