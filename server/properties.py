"""TorchServe's config.properties: read and write it, its listeners, its keys, free loopback ports.

What a client of a server needs to reach it (``Addresses``, ``Keys``) and what a second server needs
so as not to disturb a running one (``config_on_free_ports``).
"""

from __future__ import annotations

import json
import socket
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

PATH_PROPERTIES = ("metrics_config", "model_store")
KEY_FILE = "key_file.json"  # written by TorchServe into its working directory
EFFECTIVE_CONFIG = "config.properties"  # in the working directory, beside the key file


def read_properties(path: Path) -> dict[str, str]:
    """A Java .properties file as a dict (the subset TorchServe uses: key=value lines, # comments)."""
    properties = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            properties[key.strip()] = value.strip()
    return properties


def write_properties(path: Path, properties: dict[str, str]) -> Path:
    path.write_text("".join(f"{key}={value}\n" for key, value in properties.items()))
    return path


def with_absolute_paths(properties: dict[str, str], base: Path) -> dict[str, str]:
    """``properties`` with relative file paths (PATH_PROPERTIES) taken relative to ``base``."""
    resolved = dict(properties)
    for key in PATH_PROPERTIES:
        if key in resolved and not Path(resolved[key]).is_absolute():
            resolved[key] = str((base / resolved[key]).resolve())
    return resolved


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports on loopback, free right now. Each socket stays bound until all
    are picked: a port released at once could be picked again."""
    with ExitStack() as sockets:
        bound = [sockets.enter_context(socket.socket()) for _ in range(count)]
        for sock in bound:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in bound]


def free_port() -> int:
    """A TCP port on loopback that is free right now."""
    return free_ports(1)[0]


def config_on_free_ports(config: Path, directory: Path, **overrides: str) -> Path:
    """A copy of ``config`` in ``directory`` with every port on a distinct free loopback port (so a
    second server does not disturb a running one) and its file paths made absolute."""
    properties = with_absolute_paths(read_properties(config), config.parent)
    inference, management, metrics, grpc_inference, grpc_management, worker = free_ports(6)
    properties.update(
        inference_address=f"http://127.0.0.1:{inference}",
        management_address=f"http://127.0.0.1:{management}",
        metrics_address=f"http://127.0.0.1:{metrics}",
        grpc_inference_port=str(grpc_inference),
        grpc_management_port=str(grpc_management),
        initial_worker_port=str(worker),
        **overrides,
    )
    return write_properties(directory / "config.properties", properties)


# TorchServe's listeners and their defaults.
DEFAULT_ADDRESSES = {
    "inference_address": "http://127.0.0.1:8080",
    "management_address": "http://127.0.0.1:8081",
    "metrics_address": "http://127.0.0.1:8082",
}
GRPC_ADDRESS_PROPERTIES = ("grpc_inference_address", "grpc_management_address")
ALL_INTERFACES = "0.0.0.0"


def bound_to(properties: dict[str, str], host: str) -> dict[str, str]:
    """``properties`` with the HTTP and gRPC listeners on ``host``, ports kept."""
    bound = dict(properties)
    for key, default in DEFAULT_ADDRESSES.items():
        parsed = urlparse(properties.get(key, default))
        bound[key] = f"{parsed.scheme}://{host}:{parsed.port}"
    bound.update({key: host for key in GRPC_ADDRESS_PROPERTIES})
    return bound


def token_authorization(properties: dict[str, str]) -> bool:
    """Whether TorchServe with these properties demands keys (it does unless disabled)."""
    return properties.get("disable_token_authorization", "false").lower() != "true"


def reachable(properties: dict[str, str]) -> dict[str, str]:
    """``properties`` as a local client reaches them: a server on all interfaces via loopback."""
    hosts = {urlparse(properties.get(key, default)).hostname for key, default in DEFAULT_ADDRESSES.items()}
    return bound_to(properties, "127.0.0.1") if ALL_INTERFACES in hosts else properties


@dataclass(frozen=True)
class Addresses:
    inference: str
    management: str
    metrics: str
    grpc_inference: str  # host:port, a gRPC target

    @classmethod
    def from_properties(cls, properties: dict[str, str]) -> Addresses:
        inference, management, metrics = (properties.get(key, default) for key, default in DEFAULT_ADDRESSES.items())
        grpc_inference = (
            f"{properties.get('grpc_inference_address', '127.0.0.1')}:{properties.get('grpc_inference_port', '7070')}"
        )
        return cls(inference=inference, management=management, metrics=metrics, grpc_inference=grpc_inference)


@dataclass(frozen=True)
class Keys:
    inference: str
    management: str
    api: str = ""  # the token API's key, which does not expire: it renews the other two

    @classmethod
    def from_key_file(cls, path: Path) -> Keys:
        data = json.loads(path.read_text())
        return cls(data["inference"]["key"], data["management"]["key"], data.get("API", {}).get("key", ""))

    def authorization(self, management: bool = False) -> dict[str, str]:
        """The Authorization header for the inference (or management) API."""
        return {"Authorization": f"Bearer {self.management if management else self.inference}"}


def reach(workdir: Path) -> tuple[Addresses, dict[str, str]]:
    """How a client on this host reaches the server whose working directory is ``workdir``: its
    addresses and the headers its inference API wants, from the effective config.properties and the
    key_file.json TorchServe leaves there. Raises OSError, ValueError or KeyError where they are
    missing or unreadable."""
    properties = read_properties(workdir / EFFECTIVE_CONFIG)
    headers = Keys.from_key_file(workdir / KEY_FILE).authorization() if token_authorization(properties) else {}
    return Addresses.from_properties(reachable(properties)), headers
