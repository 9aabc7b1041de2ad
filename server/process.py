"""Run TorchServe: one frontend and its workers in their own process group and working directory.

``TorchServe`` starts it in the foreground, waits until a worker is ready (failing fast when a
worker cannot load the model), scrapes its metrics, drains it (no new requests, those in flight
answered) and stops it with nothing left behind;
``serve_archive`` packages a model and serves it on free loopback ports for the length of a block,
which is how the tests, the load tests, the benchmarks and the observability tools get a server of
their own. ``python -m server.cli`` (``make serve``) runs the same class.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple, TypeVar

import requests
from prometheus_client.parser import text_string_to_metric_families

from server.archive import MODEL_NAME, archive_model_config, build, console_script
from server.control import CONTROL_DIR_ENV, ControlDir
from server.group import TERMINATE_SECONDS, stop_group
from server.paths import CONFIG_PROPERTIES, CONTROLNET_DIR, LOG_CONFIG, LORA_DIR
from server.properties import (
    EFFECTIVE_CONFIG,
    KEY_FILE,
    Addresses,
    Keys,
    bound_to,
    config_on_free_ports,
    reachable,
    read_properties,
    token_authorization,
    with_absolute_paths,
    write_properties,
)

logger = logging.getLogger("server")

LOAD_FAILED = "Load model failed"  # logged by the frontend each time a worker dies while loading
FRONTEND_STARTED = "Model server started."  # printed by the frontend once every listener is bound
PORT_IN_USE = "Address already in use"  # logged by the frontend when a listener cannot bind, before it exits
# What a request's last metric lines and its answer update: settled, every line has been parsed.
SETTLED_METRICS = ("sd_request_latency_seconds", "sd_encode_seconds", "ts_inference_")
START_ATTEMPTS = 3  # starts on fresh free ports (start_on_free_ports) before a port taken each time fails
DEFAULT_STARTUP_TIMEOUT = 120  # TorchServe's startupTimeout when model-config.yaml sets none
FRONTEND_START_SECONDS = 120  # the frontend's own start and the archive's registration, before a worker loads
# handler/config.py's defaults (a unit test keeps them equal): TorchServe's responseTimeout where
# model-config.yaml sets none, and the share of it a request may take in the worker.
TORCHSERVE_RESPONSE_TIMEOUT = 120
REQUEST_TIMEOUT_SHARE = 0.9
# Of a stop's grace period, the end kept for the answers of the requests cancelled at its end.
ANSWER_MARGIN_SECONDS = 5.0
DRAIN_POLL_SECONDS = 0.1
# A drained server has had nothing in flight and no arrival for this long beyond maxBatchDelay.
DRAIN_QUIET_SECONDS = 0.5
# No denoising step for this long while requests count as in flight: the drain probes (TorchServe.drain).
DRAIN_PROBE_SECONDS = 5.0
IN_FLIGHT_GAUGE = "sd_in_flight_requests"
RECEIVED_COUNTER = "ts_inference_requests_total"
STEPS_COUNTER = "sd_denoise_step_seconds_count"


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


def request_time_limit(model_config: dict) -> float:
    """The longest a request may take in a worker: ``handler.request_timeout_s``, by default 90%
    of ``responseTimeout`` (past it the worker cancels the request with a 504)."""
    limit = (model_config.get("handler") or {}).get("request_timeout_s")
    if limit is None:
        limit = REQUEST_TIMEOUT_SHARE * float(model_config.get("responseTimeout", TORCHSERVE_RESPONSE_TIMEOUT))
    return float(limit)


def default_stop_grace(model_config: dict) -> float:
    """A stop's default grace period: long enough for the longest request the limits allow (one
    admitted just before the stop) to finish, plus the margin kept for answers."""
    return request_time_limit(model_config) + ANSWER_MARGIN_SECONDS


def archive_stop_grace(model_store: Path, model_name: str = MODEL_NAME) -> float:
    """``default_stop_grace`` for the archive of ``model_name`` in ``model_store``."""
    return default_stop_grace(archive_model_config(model_store, find_archive(model_store, model_name)))


class Activity(NamedTuple):
    """What a drain watches (``TorchServe.activity``)."""

    left: int  # requests not yet answered
    received: float  # requests received so far
    steps: float  # denoising steps taken so far
    gathering: float  # seconds a request can spend being gathered into a batch, seen nowhere


class PortInUse(RuntimeError):
    """A server exited at its start: one of its ports was taken."""


class TorchServe:
    """One TorchServe frontend (and its workers) in its own process group and working directory."""

    def __init__(
        self,
        config: Path,
        model_store: Path,
        workdir: Path,
        model_name: str = MODEL_NAME,
        env: dict[str, str] | None = None,
        bind: str | None = None,
    ):
        self.config = config.resolve()
        self.model_store = model_store.resolve()
        self.workdir = workdir.resolve()
        self.model_name = model_name
        self.bind = bind
        properties = self._properties()
        self.addresses = Addresses.from_properties(reachable(properties))
        self.token_authorization = token_authorization(properties)
        self.control = ControlDir.of(self.workdir)
        self.env = {**os.environ, **(env or {}), CONTROL_DIR_ENV: str(self.control.path)}
        self.process: subprocess.Popen | None = None
        self.keys: Keys | None = None
        self.started = False  # every listener bound and the management API answered (wait_started)
        self._log_offset = 0

    @classmethod
    def attach(cls, workdir: Path, model_name: str = MODEL_NAME) -> TorchServe:
        """The server already running from ``workdir`` (``python -m server.cli``), reached through
        the configuration and keys it left there: to describe, scale or drain it."""
        workdir = workdir.resolve()
        config = workdir / EFFECTIVE_CONFIG
        server = cls(config, Path(read_properties(config).get("model_store", ".")), workdir, model_name)
        if server.token_authorization:
            server.keys = Keys.from_key_file(workdir / KEY_FILE)
        server.started = True
        return server

    @property
    def predictions_url(self) -> str:
        """The inference API's endpoint for the model."""
        return f"{self.addresses.inference}/predictions/{self.model_name}"

    @property
    def model_url(self) -> str:
        """The management API's endpoint for the model (describe, scale)."""
        return f"{self.addresses.management}/models/{self.model_name}"

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
        """Launch ``torchserve --foreground`` with key_file.json and logs in the working directory
        (``LOG_CONFIG`` says what is logged); with ``load_model`` the model archive is loaded at start."""
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        (self.workdir / KEY_FILE).unlink(missing_ok=True)
        self.control.reset()
        command = [
            console_script("torchserve"),
            "--start",
            "--foreground",
            "--ncs",
            "--ts-config",
            str(self._effective_config()),
            "--model-store",
            str(self.model_store),
            "--log-config",
            str(LOG_CONFIG),
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

    def _check_alive(self) -> str:
        """Fail fast when TorchServe exited or a worker failed to load the model (it would retry
        forever); return what it logged since its start."""
        log = self._log_since_start()
        if self.process is None or self.process.poll() is not None:
            error = PortInUse if PORT_IN_USE in log else RuntimeError
            raise error(f"TorchServe exited before it was ready; end of {self.console_log}:\n{log[-3000:]}")
        if LOAD_FAILED in log:
            worker_lines = [line.split(" - ", 1)[-1] for line in log.splitlines() if "MODEL_LOG" in line]
            raise RuntimeError(f"a worker failed to load {self.model_name}:\n" + "\n".join(worker_lines[-40:]))
        return log

    def wait_started(self, timeout: float = 300.0) -> Keys | None:
        """Wait until the frontend bound every listener (the HTTP APIs bind before gRPC's),
        key_file.json is written (with token authorization) and the management API answers;
        return the keys."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if FRONTEND_STARTED in self._check_alive() and self._management_answers():
                self.started = True
                return self.keys
            time.sleep(0.1)
        raise TimeoutError(f"TorchServe did not start within {timeout:.0f} s; see {self.console_log}")

    def _management_answers(self) -> bool:
        """Whether the management API answers, with the keys from key_file.json once it is written
        (with token authorization)."""
        key_file = self.workdir / KEY_FILE
        if self.token_authorization and self.keys is None and key_file.is_file():
            try:
                self.keys = Keys.from_key_file(key_file)
            except (json.JSONDecodeError, KeyError):
                pass  # still being written
        if self.token_authorization and self.keys is None:
            return False
        try:
            requests.get(f"{self.addresses.management}/models", headers=self.auth(management=True), timeout=5)
        except requests.ConnectionError:
            return False
        return True

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
            time.sleep(0.2)
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

    def settled_metric_samples(self) -> dict[tuple[str, frozenset], float]:
        """``metric_samples`` once the frontend has parsed every metric line the worker printed (it
        parses them on a thread of its own): two scrapes 0.1 s apart agree on the requests counted
        (at most 5 s). A request's latency line follows its steps' and decodes'."""

        def counted(samples: dict[tuple[str, frozenset], float]) -> dict:
            return {key: value for key, value in samples.items() if key[0].startswith(SETTLED_METRICS)}

        samples = self.metric_samples()
        for _ in range(50):
            time.sleep(0.1)
            again = self.metric_samples()
            if counted(again) == counted(samples):
                return again
            samples = again
        return samples

    def management(self, method: str, url: str, **kwargs) -> requests.Response:
        """A management API call. With token authorization, a 400 (the management key expired:
        keys last ``token_expiration_min``) renews the key with the token API once and retries."""
        extra_headers = kwargs.pop("headers", {})
        response = requests.request(method, url, headers={**self.auth(management=True), **extra_headers}, **kwargs)
        if response.status_code == 400 and self.token_authorization and self.keys and self.keys.api:
            renewed = requests.post(
                f"{self.addresses.management}/token",
                params={"type": "management"},
                headers={"Authorization": f"Bearer {self.keys.api}"},
                timeout=30,
            )
            if renewed.status_code == 200:
                self.keys = Keys.from_key_file(self.workdir / KEY_FILE)
                headers = {**self.auth(management=True), **extra_headers}
                response = requests.request(method, url, headers=headers, **kwargs)
        return response

    def worker_status(self) -> list[str]:
        """Status of each worker of the model, from the management API ([] while unknown)."""
        try:
            response = self.management("GET", self.model_url, timeout=5)
        except requests.ConnectionError:
            return []
        if response.status_code != 200:
            return []
        return [worker["status"] for model in response.json() for worker in model.get("workers", [])]

    def describe(self) -> dict:
        """The management API's description of the model: settings (``continuousBatching``,
        ``batchSize``, ``minWorkers``, ...) and workers (``id``, ``pid``, ``status``)."""
        response = self.management("GET", self.model_url, timeout=30)
        response.raise_for_status()
        return response.json()[0]

    def scale(self, workers: int, timeout: float = 600) -> requests.Response:
        """Ask the management API for exactly ``workers`` workers and wait for the outcome."""
        params = {"min_worker": workers, "max_worker": workers, "synchronous": "true"}
        return self.management("PUT", self.model_url, params=params, timeout=timeout)

    def activity(self) -> Activity:
        """Requests not yet answered (waiting in the frontend's queue, or in a worker: its
        ``sd_in_flight_requests`` gauge, current workers only), requests received so far
        (``ts_inference_requests_total``, counted as they arrive), denoising steps taken so far, and
        the seconds a request can spend being gathered into a batch, unseen by both (``maxBatchDelay``)."""
        described = self.describe()
        workers = {worker["id"] for worker in described["workers"]}
        in_workers, received, steps = 0.0, 0.0, 0.0
        for (name, labels), value in self.metric_samples().items():
            if name == IN_FLIGHT_GAUGE and dict(labels).get("worker") in workers:
                in_workers += value
            elif name == RECEIVED_COUNTER:
                received += value
            elif name == STEPS_COUNTER:
                steps += value
        pending = described["jobQueueStatus"]["pendingRequests"]
        return Activity(int(in_workers) + pending, received, steps, described["maxBatchDelay"] / 1000)

    def drain(self, grace_s: float) -> tuple[float, int]:
        """Stop taking requests (the workers answer new ones 503 with ``Retry-After``; the health
        check fails) and wait until those in flight are answered or the grace period ends (the
        workers answer what is left 503 just before). Returns the seconds it took and the
        requests still unanswered then.

        A request the frontend is gathering into a batch shows nowhere for up to ``maxBatchDelay``,
        so the server counts as drained once nothing is in flight and nothing new arrived for
        longer than that. Requests in flight while no step is taken for ``DRAIN_PROBE_SECONDS`` get a
        probe (``_probe``): their clients may have left."""
        drain = self.control.begin_drain(grace_s, min(ANSWER_MARGIN_SECONDS, grace_s / 4))
        logger.info("draining: no new requests; waiting up to %.0f s for those in flight", drain["ends"] - time.time())
        quiet_since = stalled_since = time.monotonic()
        left, received, steps, shown = 0, None, None, None
        while time.time() < drain["ends"] and self.process is not None and self.process.poll() is None:
            try:
                now = self.activity()
            except (requests.RequestException, RuntimeError, KeyError, IndexError) as error:
                if not self.started:  # no request can be in flight yet
                    logger.info("the server had not started (%s); stopping", error)
                    break
                logger.warning("cannot read the requests in flight (%s); trying again", error)
                time.sleep(1.0)
                continue
            left = now.left
            if left or now.received != received:
                quiet_since, received = time.monotonic(), now.received
            elif time.monotonic() - quiet_since >= now.gathering + DRAIN_QUIET_SECONDS:
                break
            if not left or now.steps != steps or left != shown:
                stalled_since, steps = time.monotonic(), now.steps
            elif time.monotonic() - stalled_since >= DRAIN_PROBE_SECONDS:
                self._probe(left)
                stalled_since = time.monotonic()
            if left != shown:
                logger.info("requests in flight: %d", left)
                shown = left
            time.sleep(DRAIN_POLL_SECONDS)
        return time.time() - drain["started"], max(left, 0)

    def _probe(self, left: int) -> None:
        """One request of the drain's own, answered 503 by a worker that is stopping. With continuous
        batching TorchServe drops a request whose client left and calls the worker only while it
        holds a request, so a worker whose every client left would count them in flight until the
        grace period ends; the probe's call shows it which ones are gone."""
        logger.info(
            "%d request(s) in flight and no step for %.0f s: probing for clients that left", left, DRAIN_PROBE_SECONDS
        )
        try:
            requests.post(self.predictions_url, json={"prompt": "drain probe"}, headers=self.auth(), timeout=30)
        except requests.RequestException as error:
            logger.warning("the drain's probe got no answer (%s)", error)

    def auth(self, management: bool = False) -> dict[str, str]:
        """The Authorization header for the inference (or management) API; none without token authorization."""
        if not self.token_authorization:
            return {}
        if self.keys is None:
            raise RuntimeError("keys are known once the server has started")
        return self.keys.authorization(management)

    def stop(self, grace: float = TERMINATE_SECONDS) -> None:
        """SIGTERM the process group (the frontend stops its workers), SIGKILL what is left after
        ``grace`` seconds; with ``grace`` 0, SIGKILL at once."""
        if self.process is None:
            return
        stop_group(self.process, [(signal.SIGTERM, grace)] if grace > 0 else [], "TorchServe")
        logger.info("TorchServe stopped")

    def __enter__(self) -> TorchServe:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def start_on_free_ports(
    model_store: Path,
    workdir: Path,
    model_name: str = MODEL_NAME,
    env: dict[str, str] | None = None,
    load_model: bool = True,
    **properties: str,
) -> TorchServe:
    """TorchServe serving ``model_store`` from ``workdir / "server"`` on free loopback ports
    (config.properties plus ``properties``, written into ``workdir``), once its management API
    answers. Another process may take a port between its pick and the frontend's bind; the
    frontend then exits, and it is started again on fresh ports, up to ``START_ATTEMPTS`` times."""

    def start() -> TorchServe:
        config = config_on_free_ports(CONFIG_PROPERTIES, workdir, **properties)
        server = TorchServe(config, model_store, workdir / "server", model_name, env)
        server.start(load_model)
        try:
            server.wait_started()
        except BaseException:
            server.stop(0)
            raise
        return server

    return again_on_taken_port(start, "TorchServe")


Started = TypeVar("Started")


def again_on_taken_port(start: Callable[[], Started], name: str) -> Started:
    """``start()`` (a server on fresh free ports, stopped again where it fails), called again while it
    raises ``PortInUse``, up to ``START_ATTEMPTS`` times."""
    for attempt in range(1, START_ATTEMPTS):
        try:
            return start()
        except PortInUse:
            logger.warning("a port of %s's was taken (start %d of %d); starting again", name, attempt, START_ATTEMPTS)
    return start()


@contextmanager
def serve_archive(
    model_dir: Path,
    model_config: Path,
    workdir: Path,
    startup_timeout: float | None = None,
    gpus: int | None = None,
    stop_grace: float = TERMINATE_SECONDS,
    **properties: str,
) -> Iterator[TorchServe]:
    """Build the archive from ``model_dir`` and ``model_config`` (workers for ``gpus`` GPUs, default
    the visible ones) and serve it from ``workdir`` on free loopback ports (config.properties plus
    ``properties``, ``start_on_free_ports``) until the block ends, waiting for a ready worker
    ``startup_timeout`` seconds (default: as long as the archive's ``startupTimeout`` allows), then
    stop it (``stop_grace``: ``TorchServe.stop``'s). As ``make serve`` does, the workers read LoRAs
    from ``$LORA_DIR``, else the checkout's ``loras/``, and ControlNets from ``$CONTROLNET_DIR``,
    else the checkout's ``controlnets/``."""
    model_store = build(model_dir, model_config, workdir / "model_store", gpus=gpus).parent
    env = {
        "TMPDIR": str(workdir),
        "LORA_DIR": os.environ.get("LORA_DIR", str(LORA_DIR)),
        "CONTROLNET_DIR": os.environ.get("CONTROLNET_DIR", str(CONTROLNET_DIR)),
    }
    server = start_on_free_ports(model_store, workdir, env=env, **properties)
    try:
        server.wait_ready(startup_timeout or archive_ready_timeout(model_store, server.model_name))
        yield server
    finally:
        server.stop(stop_grace)
