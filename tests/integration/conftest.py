"""Session servers: a real TorchServe on loopback serving the real archive, built from the default
(trained) model: with the shipped model-config.yaml (``server``), and in each TorchServe batching
mode explicitly (``dynamic_server``, ``continuous_server``; one of them is the shipped server)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from server import KEY_FILE, TorchServe, write_model_config
from tests.harness.serving import SHIPPED_CONTINUOUS, Client, serving


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
    with serving(tmp, write_model_config(tmp, continuousBatching=continuous)) as instance:
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


@pytest.fixture
def cwd(tmp_path, server) -> Path:
    """A working directory whose ``runtime/key_file.json`` is the server's."""
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / KEY_FILE).symlink_to(server.workdir / KEY_FILE)
    return tmp_path
