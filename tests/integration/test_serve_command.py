"""Starting the server. The start script that `make serve` and the container run (serving a
no-archive model directory): ready message with a working curl, the health check, clean stop on
Ctrl-C or SIGTERM. A server on free ports (the tests', the benchmarks') whose port was taken before
it bound it starts again on fresh ones."""

from __future__ import annotations

import shlex
import signal
import socket
import subprocess
from urllib.parse import urlparse

import pytest
import requests

from server import properties, read_properties, start_on_free_ports
from server.process import PORT_IN_USE
from server.properties import EFFECTIVE_CONFIG
from tests.harness.images import decode_png
from tests.harness.start_script import group_members, healthcheck, server_process_group, start_script


@pytest.mark.parametrize(
    ("bind_address", "stop_signal"),
    [
        (None, signal.SIGINT),  # make serve, stopped with Ctrl-C
        ("0.0.0.0", signal.SIGTERM),  # the container, stopped by `docker stop`
    ],
    ids=["make-serve", "container"],
)
def test_start_script_serves_a_working_curl_and_stops_leaving_no_process(tmp_path, bind_address, stop_signal):
    """server/start.sh as `make serve` and the container run it, in a temporary directory: it
    packages the model (no-archive), serves it, prints a working curl, passes the health check
    (which reads the key itself), and stops cleanly."""
    runtime = tmp_path / "runtime"
    env = {"BIND_ADDRESS": bind_address} if bind_address else {}
    with start_script(tmp_path, **env) as started:
        curl, serve = started.curl, started.process
        assert "Authorization: Bearer " in curl and "/predictions/stable-diffusion" in curl
        result = subprocess.run(shlex.split(curl), cwd=tmp_path, capture_output=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert decode_png((tmp_path / "image.png").read_bytes()).shape == (64, 64, 3)
        check = healthcheck(runtime)
        assert check.returncode == 0 and "Healthy" in check.stdout, check.stdout
        effective = read_properties(runtime / EFFECTIVE_CONFIG)
        assert urlparse(effective["inference_address"]).hostname == (bind_address or "127.0.0.1")
        group = server_process_group(tmp_path / "model_store")
        assert len(group_members(group)) >= 2, "the frontend and a worker should be running"
        serve.send_signal(stop_signal)
        assert serve.wait(timeout=120) == 0
    assert group_members(group) == [], "TorchServe processes outlived the start script"
    assert not (runtime / "server.pid").exists()
    assert healthcheck(runtime).returncode == 1, "the health check passes with no server"


def test_a_server_whose_port_was_taken_before_it_bound_starts_again_on_fresh_ports(tmp_path, monkeypatch):
    """Another process takes the first pick's gRPC inference port before TorchServe binds it. The
    frontend binds its HTTP APIs first, then fails on gRPC's and exits; ``start_on_free_ports``
    waits for every listener, sees it exit and starts it again on fresh ports."""
    picks: list[list[int]] = []
    pick = properties.free_ports

    def first_grpc_port_taken(count: int) -> list[int]:
        ports = pick(count)  # inference, management, metrics, gRPC inference, ... (config_on_free_ports)
        if not picks:
            ports[3] = taken.getsockname()[1]
        picks.append(ports)
        return ports

    monkeypatch.setattr(properties, "free_ports", first_grpc_port_taken)
    (tmp_path / "model_store").mkdir()
    with socket.create_server(("127.0.0.1", 0)) as taken:
        server = start_on_free_ports(tmp_path / "model_store", tmp_path, load_model=False)
        try:
            assert len(picks) == 2 and taken.getsockname()[1] not in picks[1]
            assert PORT_IN_USE in server.console_log.read_text()
            assert requests.get(f"{server.addresses.inference}/ping", headers=server.auth(), timeout=30).ok
        finally:
            server.stop(0)
