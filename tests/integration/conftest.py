"""A real TorchServe on loopback serving the real archive, built from the default (trained) model:
with the shipped model-config.yaml (``server``), and in each TorchServe batching mode explicitly
(``dynamic_server``, ``continuous_server``; one of them is the shipped server)."""

from __future__ import annotations

import base64
import io
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import requests
import yaml
from PIL import Image

from scripts.build_mar import DEFAULT_MODEL_DIR, write_model_config as model_config
from scripts.server import KEY_FILE, TorchServe, serve_archive

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = DEFAULT_MODEL_DIR
STARTUP_TIMEOUT = 600
SHIPPED_CONFIG = yaml.safe_load((ROOT / "model-config.yaml").read_text())
SHIPPED_CONTINUOUS = bool(SHIPPED_CONFIG.get("continuousBatching"))


@contextmanager
def serving(tmp: Path, config: Path = ROOT / "model-config.yaml", model_dir: Path = MODEL_DIR,
            **properties: str) -> Iterator[TorchServe]:
    """The real archive of ``model_dir``, built with ``config``, served on free loopback ports
    (config.properties plus ``properties``) until the block ends."""
    if not (model_dir / "model_index.json").is_file():
        pytest.fail(f"{model_dir} is missing: the default model is committed (`make train-default-model` rebuilds "
                    "it); the tiny ones come from `make model`")
    with serve_archive(model_dir, config, tmp, STARTUP_TIMEOUT, gpus=1, **properties) as server:  # one worker, GPU or not
        yield server


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Iterator[TorchServe]:
    with serving(tmp_path_factory.mktemp("torchserve")) as instance:
        yield instance


def _mode_server(request, tmp_path_factory, continuous: bool) -> Iterator[TorchServe]:
    """The shipped server when it runs this batching mode, else one of its own."""
    if SHIPPED_CONTINUOUS == continuous:
        yield request.getfixturevalue("server")
        return
    tmp = tmp_path_factory.mktemp("continuous" if continuous else "dynamic")
    with serving(tmp, model_config(tmp, continuousBatching=continuous)) as instance:
        yield instance


@pytest.fixture(scope="session")
def dynamic_server(request, tmp_path_factory) -> Iterator[TorchServe]:
    yield from _mode_server(request, tmp_path_factory, continuous=False)


@pytest.fixture(scope="session")
def continuous_server(request, tmp_path_factory) -> Iterator[TorchServe]:
    yield from _mode_server(request, tmp_path_factory, continuous=True)


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


@pytest.fixture(scope="session")
def dynamic_client(dynamic_server) -> Client:
    return Client(dynamic_server)


@pytest.fixture(scope="session")
def continuous_client(continuous_server) -> Client:
    return Client(continuous_server)


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


# The README's examples (``<!-- example: NAME -->`` before a fenced block), run as written: only the
# loopback ports are the test server's, and ``runtime/key_file.json`` is that server's key file.
EXAMPLE = re.compile(r"<!-- example: (?P<name>[\w-]+) -->\n```(?P<language>\w+)\n(?P<code>.*?)```", re.DOTALL)
RUNNERS = {"bash": ["bash", "-euo", "pipefail", "-c"], "python": [sys.executable, "-c"]}


def readme_examples() -> dict[str, tuple[str, str]]:
    """Name -> (language, code) of every example marked ``<!-- example: NAME -->`` in the README."""
    return {match["name"]: (match["language"], match["code"]) for match in EXAMPLE.finditer((ROOT / "README.md").read_text())}


def run_example(name: str, server: TorchServe, cwd: Path) -> subprocess.CompletedProcess:
    language, code = readme_examples()[name]
    code = code.replace("http://127.0.0.1:8080", server.addresses.inference).replace(
        "http://127.0.0.1:8081", server.addresses.management)
    result = subprocess.run(RUNNERS[language] + [code], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"README example {name!r} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture
def cwd(tmp_path, server) -> Path:
    """A working directory whose ``runtime/key_file.json`` is the server's."""
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / KEY_FILE).symlink_to(server.workdir / KEY_FILE)
    return tmp_path
