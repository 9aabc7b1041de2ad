"""The start script that `make serve` and the container run (serving a no-archive model directory):
ready message with a working curl, the health check, clean stop on Ctrl-C or SIGTERM."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import urlparse

import psutil
import pytest

from server import config_on_free_ports, read_properties
from server.paths import CONFIG_PROPERTIES, ROOT
from server.properties import EFFECTIVE_CONFIG
from tests.harness.images import decode_png
from tests.harness.serving import MODEL_DIR, STARTUP_TIMEOUT


def read_until_curl(process: subprocess.Popen, timeout: float) -> tuple[str | None, list[str]]:
    """Read the command's output until it prints the curl line (or exits, or times out)."""
    lines: list[str] = []
    found: list[str] = []

    def reader() -> None:
        for line in process.stdout:
            lines.append(line)
            if line.strip().startswith("curl "):
                found.append(line.strip())
                return

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    thread.join(timeout)
    return (found[0] if found else None), lines


def server_process_group(model_store: Path) -> int:
    """The process group of the TorchServe frontend serving ``model_store`` (workers share it)."""
    for process in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if "org.pytorch.serve.ModelServer" in cmdline and str(model_store) in cmdline:
            return os.getpgid(process.pid)
    raise AssertionError(f"no TorchServe process serves {model_store}")


def group_members(group: int) -> list[int]:
    members = []
    for process in psutil.process_iter(["status"]):
        try:
            if os.getpgid(process.pid) == group and process.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(process.pid)
        except ProcessLookupError:
            continue
    return members


def healthcheck(workdir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "server.healthcheck", "--workdir", str(workdir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )


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
    env = {
        **os.environ,
        "TMPDIR": str(tmp_path),
        "PYTHON": sys.executable,
        "MODEL_DIR": str(MODEL_DIR),
        "MODEL_STORE": str(tmp_path / "model_store"),
        "ARCHIVE_FORMAT": "no-archive",
        "WORKDIR": str(runtime),
        "CONFIG": str(config_on_free_ports(CONFIG_PROPERTIES, tmp_path)),
    }
    if bind_address:
        env["BIND_ADDRESS"] = bind_address
    serve = subprocess.Popen(
        [str(ROOT / "server" / "start.sh")],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        curl, output = read_until_curl(serve, STARTUP_TIMEOUT)
        assert curl, "no curl printed:\n" + "".join(output)
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
    finally:
        serve.send_signal(stop_signal)
        assert serve.wait(timeout=120) == 0
    assert group_members(group) == [], "TorchServe processes outlived the start script"
    assert not (runtime / "server.pid").exists()
    assert healthcheck(runtime).returncode == 1, "the health check passes with no server"
