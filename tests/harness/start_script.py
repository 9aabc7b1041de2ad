"""``server/start.sh`` (what ``make serve`` and the container run) as a process of a test: started
in a temporary directory, read until it prints its curl, its processes, its health check."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from server import TorchServe, config_on_free_ports
from server.paths import CONFIG_PROPERTIES, ROOT
from server.process import START_ATTEMPTS, PortInUse
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


def exited_on_a_taken_port(process: subprocess.Popen, output: list[str]) -> bool:
    """Whether the script exited because its server could not bind a port (its traceback names
    ``PortInUse``)."""
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        return False
    return PortInUse.__name__ in "".join(output)


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


def start_script_env(tmp_path: Path, **env: str) -> dict[str, str]:
    """The environment of a start script serving the default model (no-archive) from ``tmp_path``."""
    return {
        **os.environ,
        "TMPDIR": str(tmp_path),
        "PYTHON": sys.executable,
        "MODEL_DIR": str(MODEL_DIR),
        "MODEL_STORE": str(tmp_path / "model_store"),
        "ARCHIVE_FORMAT": "no-archive",
        "WORKDIR": str(tmp_path / "runtime"),
        "CONFIG": str(config_on_free_ports(CONFIG_PROPERTIES, tmp_path)),
        **env,
    }


@dataclass(frozen=True)
class Started:
    process: subprocess.Popen
    server: TorchServe  # attached through the script's working directory
    curl: str  # the ready-to-paste request it printed
    runtime: Path  # its working directory


@contextmanager
def start_script(tmp_path: Path, **env: str) -> Iterator[Started]:
    """server/start.sh serving the default model from ``tmp_path``, once it printed its curl.
    SIGTERM and a wait at the end, if it still runs. A port taken by another process before the
    server bound it gets the script run again on fresh ports, as ``start_on_free_ports`` does."""
    for attempt in range(1, START_ATTEMPTS + 1):
        process = subprocess.Popen(
            [str(ROOT / "server" / "start.sh")],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=start_script_env(tmp_path, **env),
        )
        curl, output = read_until_curl(process, STARTUP_TIMEOUT)
        if curl or attempt == START_ATTEMPTS or not exited_on_a_taken_port(process, output):
            break
    try:
        assert curl, "no curl printed:\n" + "".join(output)
        yield Started(process, TorchServe.attach(tmp_path / "runtime"), curl, tmp_path / "runtime")
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=600)
