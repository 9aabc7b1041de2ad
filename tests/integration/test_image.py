"""The serving image, built and run (``make image-test``, slow tier).

docker/Dockerfile's CPU variant as written, only build arguments changed (a Debian 12 base made here,
the local torch wheel): built with buildah, which needs no daemon (server/image.py), then run as a
container would be: the image's own entrypoint as the image's user, its own health check until it
passes, a prompt in with the key read inside the container, a PNG out, SIGTERM with 8 requests in
flight (each gets its image: the drain), no process left.
The test keeps its images and containers in storage of its own and removes them. It skips only where
buildah or debootstrap cannot be installed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import psutil
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from server.image import Buildah, MissingTool, build_image, local_cpu_build, require
from server.paths import CONFIG_PROPERTIES
from server.properties import EFFECTIVE_CONFIG, KEY_FILE, Addresses, reach, read_properties
from tests.harness.images import decode_png

pytestmark = pytest.mark.slow

TAG = "localhost/stable-diffusion-torchserve:image-test"
HEALTHY_TIMEOUT = 600.0  # s: the image's start period is 15 min (a real model); the default model loads in seconds
STOP_TIMEOUT = 60.0
IN_FLIGHT = 8  # requests in flight when the container is stopped
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Container:
    """A working container of the image, run the way buildah runs one without a daemon: each command is
    a chroot into the container's root filesystem on the host's network, as the image's user."""

    buildah: Buildah
    name: str
    config: dict[str, Any]  # the image's Docker config: User, WorkingDir, Env, Entrypoint, Healthcheck

    def command(self, *argv: str) -> list[str]:
        run = ["run", "--isolation", "chroot", "--network", "host", "--user", self.config["User"]]
        return self.buildah.command(*run, self.name, "--", *argv)

    def run(self, *argv: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(*argv), capture_output=True, text=True, timeout=timeout)

    def env(self, name: str) -> str:
        return dict(item.split("=", 1) for item in self.config["Env"])[name]


def processes_in(root: str) -> list[psutil.Process]:
    """Every process whose root directory is ``root``: what runs in the container, however reparented."""
    found = []
    for process in psutil.process_iter():
        try:
            if os.readlink(f"/proc/{process.pid}/root") == root and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (OSError, psutil.Error):
            continue
    return found


def entrypoint_process(runner: subprocess.Popen, timeout: float = 60.0) -> psutil.Process:
    """The entrypoint's process (a container's PID 1): what buildah's chroot helper starts."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and runner.poll() is None:
        with contextlib.suppress(psutil.Error):  # buildah's helpers come and go
            for process in psutil.Process(runner.pid).children(recursive=True):
                if process.cmdline()[:1] == ["buildah-chroot-exec"] and process.children():
                    return process.children()[0]
        time.sleep(0.2)
    raise AssertionError(f"buildah run started no entrypoint (exit code {runner.poll()})")


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def image_ports() -> list[int]:
    """The ports the image's config.properties serves on (the container shares the host's network)."""
    properties = read_properties(CONFIG_PROPERTIES)
    addresses = Addresses.from_properties(properties)
    http = [urlparse(url).port or 80 for url in (addresses.inference, addresses.management, addresses.metrics)]
    grpc_inference = int(addresses.grpc_inference.rsplit(":", 1)[1])
    return [*http, grpc_inference, int(properties.get("grpc_management_port", "7071"))]


@pytest.fixture(scope="module")
def buildah(tmp_path_factory) -> Iterator[Buildah]:
    try:
        require("buildah", "debootstrap")
    except MissingTool as error:
        pytest.skip(f"cannot build the image here: {error}")
    storage = tmp_path_factory.mktemp("container-storage")
    tool = Buildah(root=storage)
    yield tool
    for args in (("rm", "--all"), ("rmi", "--all", "--force")):
        subprocess.run(tool.command(*args), capture_output=True)
    shutil.rmtree(storage, ignore_errors=True)


@pytest.fixture(scope="module")
def image(buildah, tmp_path_factory) -> str:
    scratch = tmp_path_factory.mktemp("image-build")
    build = local_cpu_build(buildah, TAG, scratch)
    log = scratch / "build.log"
    with log.open("w") as output:
        try:
            build_image(build, "buildah", buildah, pull="never", stdout=output, stderr=subprocess.STDOUT)
        except subprocess.CalledProcessError:
            pytest.fail(f"building docker/Dockerfile failed; the build log ends:\n{tail(log)}")
        finally:
            for host_path in build.volumes:  # the torch wheel (the CA bundle is the host's own)
                if host_path.is_relative_to(scratch):
                    shutil.rmtree(host_path)
    return TAG


@pytest.fixture
def container(buildah, image) -> Iterator[Container]:
    name = buildah("from", "--pull=never", "--name", "image-test", image, capture_output=True).stdout.strip()
    inspected = json.loads(buildah("inspect", "--type", "image", image, capture_output=True).stdout)
    yield Container(buildah, name, inspected["Docker"]["config"])
    buildah("rm", name, capture_output=True)


def in_flight(metrics_address: str) -> float:
    """Requests in the worker's denoising loop (``sd_in_flight_requests``, every worker)."""
    text = requests.get(f"{metrics_address}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "sd_in_flight_requests"
    )


def wait_healthy(container: Container, runner: subprocess.Popen, log: Path) -> None:
    """Run the image's health check in the container until it passes (the server must stay up)."""
    test = container.config["Healthcheck"]["Test"]
    assert test[0] == "CMD", test
    deadline = time.monotonic() + HEALTHY_TIMEOUT
    while time.monotonic() < deadline:
        assert runner.poll() is None, f"the entrypoint exited with {runner.returncode}:\n{tail(log)}"
        check = container.run(*test[1:])
        if check.returncode == 0:
            return
        time.sleep(2)
    raise AssertionError(f"not healthy after {HEALTHY_TIMEOUT:.0f} s: {check.stdout}{check.stderr}\n{tail(log)}")


def test_the_image_serves_a_prompt_as_its_user_and_stops_on_sigterm(container, tmp_path):
    busy = [port for port in image_ports() if listening(port)]
    assert not busy, f"ports {busy} are taken on this host; the container serves on them (host network)"
    config = container.config
    assert config["User"] == "model-server" and config["Entrypoint"] == ["server/start.sh"], config
    log = tmp_path / "entrypoint.log"
    with log.open("w") as output:
        runner = subprocess.Popen(
            container.command(*config["Entrypoint"], *(config.get("Cmd") or [])),
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    root = None
    try:
        entrypoint = entrypoint_process(runner)
        root = os.readlink(f"/proc/{entrypoint.pid}/root")
        wait_healthy(container, runner, log)
        image_user = int(container.run("id", "-u").stdout)
        assert image_user != 0 and {p.uids().real for p in processes_in(root)} == {image_user}

        # The key and the address, as a user reads them: inside the container.
        workdir = Path(container.env("WORKDIR"))
        for name in (KEY_FILE, EFFECTIVE_CONFIG):
            (tmp_path / name).write_text(container.run("cat", str(workdir / name)).stdout)
        addresses, headers = reach(tmp_path)
        response = requests.post(
            f"{addresses.inference}/predictions/stable-diffusion",
            json={"prompt": "a red circle", "seed": 42},
            headers=headers,
            timeout=300,
        )
        assert response.status_code == 200, response.text
        assert response.headers["Content-Type"] == "image/png" and response.content.startswith(PNG_SIGNATURE)
        assert decode_png(response.content).ndim == 3

        # docker stop with requests in flight: SIGTERM to the entrypoint's process; they finish (the
        # drain), then everything in the container must go.
        with ThreadPoolExecutor(IN_FLIGHT) as pool:
            flights = [
                pool.submit(
                    requests.post,
                    f"{addresses.inference}/predictions/stable-diffusion",
                    json={"prompt": "a blue square", "seed": seed, "num_inference_steps": 100},
                    headers=headers,
                    timeout=300,
                )
                for seed in range(IN_FLIGHT)
            ]
            while in_flight(addresses.metrics) < IN_FLIGHT:
                assert not any(flight.done() for flight in flights), "answered before the stop"
                time.sleep(0.02)
            entrypoint.send_signal(signal.SIGTERM)
            assert [flight.result().status_code for flight in flights] == [200] * IN_FLIGHT
        assert runner.wait(timeout=STOP_TIMEOUT) == 0, tail(log)
        output = log.read_text()
        assert "(0 request(s) left unanswered)" in output and "TorchServe stopped" in output, tail(log)
        deadline = time.monotonic() + 10
        while processes_in(root) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not processes_in(root), [p.cmdline() for p in processes_in(root)]
    finally:
        for process in processes_in(root) if root else []:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGKILL)
            runner.wait()
