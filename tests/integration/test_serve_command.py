"""The `make serve` command itself (serving a no-archive model directory): ready message with a
working curl, clean stop on Ctrl-C."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil

from scripts.build_mar import build
from scripts.server import config_on_free_ports
from tests.integration.conftest import MODEL_DIR, ROOT, STARTUP_TIMEOUT, decode_png


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


def test_serve_prints_a_working_curl_and_ctrl_c_leaves_no_process(tmp_path):
    build(MODEL_DIR, ROOT / "model-config.yaml", tmp_path / "model_store", archive_format="no-archive")
    command = [
        sys.executable, "-m", "scripts.server",
        "--config", str(config_on_free_ports(ROOT / "config.properties", tmp_path)),
        "--model-store", str(tmp_path / "model_store"),
        "--workdir", str(tmp_path / "runtime"),
    ]
    serve = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    try:
        curl, output = read_until_curl(serve, STARTUP_TIMEOUT)
        assert curl, "no curl printed:\n" + "".join(output)
        assert "Authorization: Bearer " in curl and "/predictions/stable-diffusion" in curl
        result = subprocess.run(shlex.split(curl), cwd=tmp_path, capture_output=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert decode_png((tmp_path / "image.png").read_bytes()).shape == (64, 64, 3)
        group = server_process_group(tmp_path / "model_store")
        assert len(group_members(group)) >= 2, "the frontend and a worker should be running"
    finally:
        serve.send_signal(signal.SIGINT)
        assert serve.wait(timeout=120) == 0
    assert group_members(group) == [], "TorchServe processes outlived the serve command"
    assert not (tmp_path / "runtime" / "server.pid").exists()
