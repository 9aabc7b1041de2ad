"""Run a real Prometheus (the Debian `prometheus` package) against a TorchServe metrics endpoint,
with the project's recording and alert rules, and query it. Used by the tests and by
``observability/render_dashboard.py``.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
from pathlib import Path
from urllib.parse import urlparse

import requests
import yaml

from server import PortInUse, again_on_taken_port, free_port
from server.paths import PROMETHEUS_DIR

logger = logging.getLogger("prometheus")

RULE_FILES = sorted((PROMETHEUS_DIR / "rules").glob("*.yml"))
INSTALL_HINT = "install it with `apt-get install -y prometheus` (.ci/run does)"
PORT_IN_USE = "address already in use"  # logged by Prometheus when its listener cannot bind, before it exits


def binary(name: str = "prometheus") -> str:
    path = shutil.which(name)
    if path is None:
        raise FileNotFoundError(f"{name} is not on PATH; {INSTALL_HINT}")
    return path


class Prometheus:
    """A Prometheus on loopback scraping one TorchServe metrics address every ``interval``."""

    def __init__(self, metrics_address: str, workdir: Path, interval: str = "1s"):
        self.workdir = workdir
        self.log = workdir / "prometheus.log"
        self.port = 0  # a free one, picked at each start
        self.config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(path) for path in RULE_FILES],
            "scrape_configs": [
                {"job_name": "torchserve", "static_configs": [{"targets": [urlparse(metrics_address).netloc]}]}
            ],
        }
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> None:
        """Start it on a free port and wait until it is ready; on a port taken before it bound, start it
        again on another (``again_on_taken_port``)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump(self.config))
        again_on_taken_port(lambda: self._start_once(config, timeout), "Prometheus")

    def _start_once(self, config: Path, timeout: float) -> None:
        """One start on a fresh free port; stopped again where it fails (``PortInUse`` where it exited on
        a taken port)."""
        self.port = free_port()
        logged = self.log.stat().st_size if self.log.exists() else 0
        command = [
            binary(),
            f"--config.file={config}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]
        with self.log.open("ab") as output:
            self.process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
        try:
            self._wait_ready(timeout, logged)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float, logged: int) -> None:
        """Until it answers ready; ``PortInUse`` where it exited on a taken port (its log past ``logged``)."""
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                if PORT_IN_USE in self.log.read_bytes()[logged:].decode(errors="replace"):
                    raise PortInUse(f"prometheus exited: port {self.port} was taken; see {self.log}")
                raise RuntimeError(f"prometheus exited; see {self.log}")
            try:
                ready = requests.get(f"{self.url}/-/ready", timeout=2).status_code == 200
                if ready and self.process.poll() is None:  # ours still runs: one that could not bind exits
                    return
            except (requests.ConnectionError, requests.Timeout):  # not listening yet, or another listener
                pass
            time.sleep(0.5)
        raise TimeoutError(f"prometheus not ready after {timeout:.0f} s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def query(self, expr: str) -> list[dict]:
        """Instant query; raises on a PromQL error, returns the (possibly empty) result."""
        response = requests.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=30)
        payload = response.json()
        if payload.get("status") != "success":
            raise ValueError(f"query {expr!r} failed: {payload.get('error')}")
        return payload["data"]["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        response = requests.get(
            f"{self.url}/api/v1/query_range",
            params={"query": expr, "start": start, "end": end, "step": step},
            timeout=60,
        )
        payload = response.json()
        if payload.get("status") != "success":
            raise ValueError(f"query_range {expr!r} failed: {payload.get('error')}")
        return payload["data"]["result"]

    def wait_for(self, expr: str, timeout: float = 60.0) -> list[dict]:
        """Poll until ``expr`` returns data (for example until the target has been scraped)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = self.query(expr)
            if result:
                return result
            time.sleep(0.5)
        raise TimeoutError(f"{expr!r} returned no data within {timeout:.0f} s")

    def rules(self) -> list[dict]:
        """Every loaded rule (recording and alerting) with its health."""
        groups = requests.get(f"{self.url}/api/v1/rules", timeout=30).json()["data"]["groups"]
        return [rule for group in groups for rule in group["rules"]]

    def __enter__(self) -> Prometheus:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()
