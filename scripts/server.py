"""Start TorchServe with the stable-diffusion archive, wait until it serves, stop it cleanly.

``python -m scripts.server`` is what ``make serve`` runs: TorchServe in the foreground on the
addresses of config.properties, a ready-to-paste curl once a worker is ready, and a clean stop
(no Java process left behind) on Ctrl-C or SIGTERM. The tests start their servers with the same
``TorchServe`` class.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import requests
from prometheus_client.parser import text_string_to_metric_families

from scripts.build_mar import archive_model_config, build, console_script

logger = logging.getLogger("server")

ROOT = Path(__file__).resolve().parent.parent
MODEL_NAME = "stable-diffusion"
STOP_GRACE_SECONDS = 60
PATH_PROPERTIES = ("metrics_config", "model_store")
KEY_FILE = "key_file.json"  # written by TorchServe into its working directory
EFFECTIVE_CONFIG = "config.properties"  # in the working directory, beside the key file
PID_FILE = "server.pid"  # `make stop` sends SIGTERM to the process named here
LOAD_FAILED = "Load model failed"  # logged by the frontend each time a worker dies while loading
DEFAULT_STARTUP_TIMEOUT = 120  # TorchServe's startupTimeout when model-config.yaml sets none
FRONTEND_START_SECONDS = 120  # the frontend's own start and the archive's registration, before a worker loads


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


def free_port() -> int:
    """A TCP port on loopback that is free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def config_on_free_ports(config: Path, directory: Path, **overrides: str) -> Path:
    """A copy of ``config`` in ``directory`` with every port on a free loopback port (so a second
    server does not disturb a running one) and its file paths made absolute."""
    properties = with_absolute_paths(read_properties(config), config.parent)
    properties.update(
        inference_address=f"http://127.0.0.1:{free_port()}",
        management_address=f"http://127.0.0.1:{free_port()}",
        metrics_address=f"http://127.0.0.1:{free_port()}",
        grpc_inference_port=str(free_port()),
        grpc_management_port=str(free_port()),
        initial_worker_port=str(free_port()),
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
        grpc_inference = f"{properties.get('grpc_inference_address', '127.0.0.1')}:{properties.get('grpc_inference_port', '7070')}"
        return cls(inference=inference, management=management, metrics=metrics, grpc_inference=grpc_inference)


@dataclass(frozen=True)
class Keys:
    inference: str
    management: str

    @classmethod
    def from_key_file(cls, path: Path) -> Keys:
        data = json.loads(path.read_text())
        return cls(inference=data["inference"]["key"], management=data["management"]["key"])


def find_archive(model_store: Path, model_name: str = MODEL_NAME) -> str:
    """The archive name TorchServe should load: ``NAME.mar`` or the no-archive directory ``NAME``."""
    if (model_store / f"{model_name}.mar").is_file():
        return f"{model_name}.mar"
    if (model_store / model_name / "MAR-INF").is_dir():
        return model_name
    raise FileNotFoundError(f"no {model_name}.mar or {model_name}/ in {model_store}; run `make mar` first")


def ready_timeout(model_config: dict) -> float:
    """How long to wait for a ready worker: the archive's ``startupTimeout`` (what TorchServe gives a
    worker to load) plus the frontend's own start."""
    return float(model_config.get("startupTimeout", DEFAULT_STARTUP_TIMEOUT)) + FRONTEND_START_SECONDS


def archive_ready_timeout(model_store: Path, model_name: str = MODEL_NAME) -> float:
    """``ready_timeout`` for the archive of ``model_name`` in ``model_store``."""
    return ready_timeout(archive_model_config(model_store, find_archive(model_store, model_name)))


class TorchServe:
    """One TorchServe frontend (and its workers) in its own process group and working directory."""

    def __init__(self, config: Path, model_store: Path, workdir: Path, model_name: str = MODEL_NAME,
                 env: dict[str, str] | None = None, bind: str | None = None):
        self.config = config.resolve()
        self.model_store = model_store.resolve()
        self.workdir = workdir.resolve()
        self.model_name = model_name
        self.bind = bind
        properties = self._properties()
        self.addresses = Addresses.from_properties(reachable(properties))
        self.token_authorization = token_authorization(properties)
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen | None = None
        self.keys: Keys | None = None
        self._log_offset = 0

    @property
    def console_log(self) -> Path:
        return self.workdir / "logs" / "console.log"

    def _properties(self) -> dict[str, str]:
        """config.properties with file paths made absolute (relative ones are relative to the
        config file, not to TorchServe's working directory), listening on ``bind`` if given."""
        properties = with_absolute_paths(read_properties(self.config), self.config.parent)
        return bound_to(properties, self.bind) if self.bind else properties

    def _effective_config(self) -> Path:
        """The configuration TorchServe runs with, written into the working directory (the
        health check reads it there)."""
        return write_properties(self.workdir / EFFECTIVE_CONFIG, self._properties())

    def start(self, load_model: bool = True) -> None:
        """Launch ``torchserve --foreground`` with key_file.json and logs in the working directory;
        with ``load_model`` the model archive is loaded at start."""
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        (self.workdir / KEY_FILE).unlink(missing_ok=True)
        command = [
            console_script("torchserve"), "--start", "--foreground", "--ncs",
            "--ts-config", str(self._effective_config()),
            "--model-store", str(self.model_store),
        ]
        if load_model:
            command += ["--models", f"{self.model_name}={find_archive(self.model_store, self.model_name)}"]
        env = {**self.env, "LOG_LOCATION": str(self.workdir / "logs"), "METRICS_LOCATION": str(self.workdir / "logs")}
        self._log_offset = self.console_log.stat().st_size if self.console_log.exists() else 0
        with open(self.console_log, "ab") as log:
            self.process = subprocess.Popen(
                command, cwd=self.workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        logger.info("TorchServe starting (pid %d), logs in %s", self.process.pid, self.workdir / "logs")

    def _log_since_start(self) -> str:
        with open(self.console_log, "rb") as log:
            log.seek(self._log_offset)
            return log.read().decode(errors="replace")

    def _check_alive(self) -> None:
        """Fail fast when TorchServe exited or a worker failed to load the model (it would retry forever)."""
        log = self._log_since_start()
        if self.process is None or self.process.poll() is not None:
            raise RuntimeError(f"TorchServe exited before it was ready; end of {self.console_log}:\n{log[-3000:]}")
        if LOAD_FAILED in log:
            worker_lines = [line.split(" - ", 1)[-1] for line in log.splitlines() if "MODEL_LOG" in line]
            raise RuntimeError(f"a worker failed to load {self.model_name}:\n" + "\n".join(worker_lines[-40:]))

    def wait_started(self, timeout: float = 300.0) -> Keys | None:
        """Wait until key_file.json is written (with token authorization) and the management API
        answers; return the keys."""
        deadline = time.monotonic() + timeout
        key_file = self.workdir / KEY_FILE
        while time.monotonic() < deadline:
            self._check_alive()
            if self.token_authorization and self.keys is None and key_file.is_file():
                try:
                    self.keys = Keys.from_key_file(key_file)
                except (json.JSONDecodeError, KeyError):
                    pass  # still being written
            if self.keys is not None or not self.token_authorization:
                try:
                    requests.get(f"{self.addresses.management}/models", headers=self.auth(management=True), timeout=5)
                    return self.keys
                except requests.ConnectionError:
                    pass
            time.sleep(0.5)
        raise TimeoutError(f"TorchServe did not start within {timeout:.0f} s; see {self.console_log}")

    def wait_ready(self, timeout: float = 900.0, progress=None) -> Keys | None:
        """Wait for a READY worker of the model; return the keys."""
        deadline = time.monotonic() + timeout
        self.wait_started(timeout)
        while time.monotonic() < deadline:
            self._check_alive()
            status = self.worker_status()
            if progress:
                progress(status)
            if "READY" in status:
                return self.keys
            time.sleep(1.0)
        raise TimeoutError(f"no READY worker for {self.model_name} after {timeout:.0f} s; see {self.console_log}")

    def metric_samples(self) -> dict[tuple[str, frozenset], float]:
        """Every sample on the metrics endpoint, keyed by name and labels (host label left out)."""
        text = requests.get(f"{self.addresses.metrics}/metrics", timeout=30).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = {key: value for key, value in sample.labels.items() if key.lower() != "hostname"}
                samples[(sample.name, frozenset(labels.items()))] = sample.value
        return samples

    def worker_status(self) -> list[str]:
        """Status of each worker of the model, from the management API ([] while unknown)."""
        try:
            response = requests.get(
                f"{self.addresses.management}/models/{self.model_name}",
                headers=self.auth(management=True), timeout=5,
            )
        except requests.ConnectionError:
            return []
        if response.status_code != 200:
            return []
        return [worker["status"] for model in response.json() for worker in model.get("workers", [])]

    def auth(self, management: bool = False) -> dict[str, str]:
        """The Authorization header for the inference (or management) API; none without token authorization."""
        if not self.token_authorization:
            return {}
        if self.keys is None:
            raise RuntimeError("keys are known once the server has started")
        return {"Authorization": f"Bearer {self.keys.management if management else self.keys.inference}"}

    def stop(self, grace: float = STOP_GRACE_SECONDS) -> None:
        """SIGTERM the process group (the frontend stops its workers), SIGKILL what is left."""
        if self.process is None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=wait)
                _wait_group_gone(self.process.pid, wait)
                break
            except subprocess.TimeoutExpired:
                logger.warning("TorchServe did not stop within %.0f s after %s", wait, sig.name)
        logger.info("TorchServe stopped")

    def __enter__(self) -> TorchServe:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


@contextmanager
def serve_archive(
    model_dir: Path, model_config: Path, workdir: Path, startup_timeout: float | None = None, gpus: int | None = None,
    **properties: str,
) -> Iterator[TorchServe]:
    """Build the archive from ``model_dir`` and ``model_config`` (workers for ``gpus`` GPUs, default
    the visible ones) and serve it from ``workdir`` on free loopback ports (config.properties plus
    ``properties``) until the block ends, waiting for a ready worker ``startup_timeout`` seconds
    (default: as long as the archive's ``startupTimeout`` allows)."""
    model_store = build(model_dir, model_config, workdir / "model_store", gpus=gpus).parent
    config = config_on_free_ports(ROOT / "config.properties", workdir, **properties)
    with TorchServe(config, model_store, workdir / "server", env={"TMPDIR": str(workdir)}) as server:
        server.wait_ready(startup_timeout or archive_ready_timeout(model_store, server.model_name))
        yield server


def _wait_group_gone(pgid: int, timeout: float) -> None:
    """Wait until no process of the group is left (workers may outlive the frontend briefly)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    raise subprocess.TimeoutExpired(f"process group {pgid}", timeout)


def example_curl(server: TorchServe) -> str:
    """A ready-to-paste request that saves a PNG."""
    body = json.dumps({"prompt": "a red circle", "seed": 42})
    headers = [f"{name}: {value}" for name, value in server.auth().items()] + ["Content-Type: application/json"]
    return (
        f"curl -sS -o image.png -X POST {server.addresses.inference}/predictions/{server.model_name} "
        + " ".join(f"-H {shlex.quote(header)}" for header in headers)
        + f" -d {shlex.quote(body)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="Serve the stable-diffusion archive with TorchServe in the foreground.")
    parser.add_argument("--config", type=Path, default=ROOT / "config.properties")
    parser.add_argument("--model-store", type=Path, default=ROOT / "model_store")
    parser.add_argument("--workdir", type=Path, default=ROOT / "runtime", help="key_file.json and logs/ go here")
    parser.add_argument("--timeout", type=float,
                        help="seconds to wait for a ready worker [the archive's startupTimeout + %d]" % FRONTEND_START_SECONDS)
    parser.add_argument("--bind", help="listen on this host instead of the config's (0.0.0.0 in a container)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")

    server = TorchServe(args.config, args.model_store, args.workdir, bind=args.bind)
    stop_requested = False

    def request_stop(signum, frame):
        nonlocal stop_requested
        stop_requested = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)  # also when started with SIGINT ignored (a background job)
    pid_file = args.workdir / PID_FILE
    try:
        args.workdir.mkdir(parents=True, exist_ok=True)
        pid_file.write_text(str(os.getpid()))
        server.start()
        seen = []

        def progress(status: list[str]) -> None:
            # The describe API reports a worker that is still loading as UNLOADING.
            shown = ", ".join("ready" if state == "READY" else "loading" for state in status) or "starting"
            if shown not in seen:
                seen.append(shown)
                logger.info("workers: %s", shown)

        timeout = args.timeout or archive_ready_timeout(server.model_store, server.model_name)
        logger.info("waiting up to %.0f s for a ready worker", timeout)
        server.wait_ready(timeout, progress)
        parsed = urlparse(server.addresses.inference)
        keys = f"Keys: {server.workdir / KEY_FILE}" if server.token_authorization else "Token authorization is off."
        print(
            f"\nstable-diffusion is ready on {parsed.netloc} (management {server.addresses.management}, "
            f"metrics {server.addresses.metrics}/metrics).\n{keys}\n"
            f"Try:\n\n  {example_curl(server)}\n\nCtrl-C stops the server.\n",
            flush=True,
        )
        server.process.wait()
        if not stop_requested:
            raise SystemExit(f"TorchServe exited with status {server.process.returncode}; see {server.console_log}")
    except KeyboardInterrupt:
        logger.info("stopping TorchServe")
    finally:
        server.stop()
        pid_file.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
