"""Session servers: a real TorchServe on loopback serving the real archive, built from the default
(trained) model: with the shipped model-config.yaml (``server``), and in each TorchServe batching
mode explicitly (``dynamic_server``, ``continuous_server``; one of them is the shipped server). They
read session copies of the checkout's LoRAs and ControlNets (``served_dirs``, through ``$LORA_DIR``
and ``$CONTROLNET_DIR`` as ``make serve`` passes them), so a test may add to those while servers of
other tests read the checkout's."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from server import KEY_FILE, TorchServe, write_model_config
from server.paths import CONTROLNET_DIR, LORA_DIR, MODEL_CONFIG
from tests.harness.serving import SHIPPED_CONTINUOUS, Client, serving


@dataclass(frozen=True)
class ServedDirs:
    loras: Path
    controlnets: Path


@pytest.fixture(scope="session")
def served_dirs(tmp_path_factory) -> ServedDirs:
    root = tmp_path_factory.mktemp("served")
    return ServedDirs(shutil.copytree(LORA_DIR, root / "loras"), shutil.copytree(CONTROLNET_DIR, root / "controlnets"))


@contextlib.contextmanager
def session_server(tmp: Path, dirs: ServedDirs, config: Path = MODEL_CONFIG) -> Iterator[TorchServe]:
    """A server started with ``$LORA_DIR`` and ``$CONTROLNET_DIR`` set to ``dirs`` (this process's
    environment is restored once it started)."""
    with contextlib.ExitStack() as stack:
        before = {name: os.environ.get(name) for name in ("LORA_DIR", "CONTROLNET_DIR")}
        os.environ.update(LORA_DIR=str(dirs.loras), CONTROLNET_DIR=str(dirs.controlnets))
        try:
            instance = stack.enter_context(serving(tmp, config))
        finally:
            for name, value in before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        yield instance


@pytest.fixture(scope="session")
def server(tmp_path_factory, served_dirs) -> Iterator[TorchServe]:
    with session_server(tmp_path_factory.mktemp("torchserve"), served_dirs) as instance:
        yield instance


def _mode_server(request, tmp_path_factory, continuous: bool) -> Iterator[TorchServe]:
    """The shipped server when it runs this batching mode, else one of its own."""
    if SHIPPED_CONTINUOUS == continuous:
        yield request.getfixturevalue("server")
        return
    tmp = tmp_path_factory.mktemp("continuous" if continuous else "dynamic")
    dirs = request.getfixturevalue("served_dirs")
    with session_server(tmp, dirs, write_model_config(tmp, continuousBatching=continuous)) as instance:
        yield instance


@pytest.fixture(scope="session")
def dynamic_server(request, tmp_path_factory) -> Iterator[TorchServe]:
    yield from _mode_server(request, tmp_path_factory, continuous=False)


@pytest.fixture(scope="session")
def continuous_server(request, tmp_path_factory) -> Iterator[TorchServe]:
    yield from _mode_server(request, tmp_path_factory, continuous=True)


@pytest.fixture(scope="session")
def client(server) -> Client:
    return Client(server)


@pytest.fixture(scope="session")
def dynamic_client(dynamic_server) -> Client:
    return Client(dynamic_server)


@pytest.fixture(scope="session")
def continuous_client(continuous_server) -> Client:
    return Client(continuous_server)


@pytest.fixture(scope="session")
def bench_scratch(tmp_path_factory) -> Path:
    """The quick benchmarks' scratch: ``make bench-gpu``'s variants section measures eager, vanilla,
    channels_last and compile-default (cold and warm) on the same workload as ``make bench-pipeline
    --quick``, which takes them from there (``--scratch <this>/variants``) instead of measuring
    them again."""
    return tmp_path_factory.mktemp("bench-scratch")


@pytest.fixture
def cwd(tmp_path, server) -> Path:
    """A working directory whose ``runtime/key_file.json`` is the server's."""
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / KEY_FILE).symlink_to(server.workdir / KEY_FILE)
    return tmp_path
