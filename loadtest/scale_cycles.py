"""Scale cycles under load (``make scale-cycles``): a model's workers go 1 -> 2 -> 1 again and again
while clients send requests back to back, scaled down through TorchServe's raw
``PUT /models/NAME?min_worker=1&max_worker=1`` or through this project's safe path
(``python -m server.cli scale``, ``server/scaling.py``). Every request's outcome is counted: a 200,
another status, a connection that ended without an answer, or no answer at all. The raw path runs
until its first cycle with a failure (its lost requests hold their clients until their answer
timeout), the safe one all its cycles; the clients do not retry, so that they count what the
server does.

The command serves the default model with dynamic batching (the mode several workers run) on a
server of its own and writes ``reports/scaling/`` (``report.md``, ``outcomes.json``,
``outcomes.png``).
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import requests  # noqa: E402

from server import ScaleError, TorchServe, scale, serve_archive, write_model_config  # noqa: E402
from server.paths import BUILD, DEFAULT_MODEL_DIR, REPORTS  # noqa: E402

logger = logging.getLogger("loadtest")

PATHS = ("raw", "safe")
BODY = {"prompt": "a red circle", "num_inference_steps": 8}
ANSWER_TIMEOUT_S = 120  # a request unanswered this long counts as lost
CME = "ConcurrentModificationException"
NO_STATUS = ("connection ended", "no answer")


@dataclass
class CycleRun:
    """What one path's cycles did to the requests sent meanwhile."""

    path: str
    cycles: int = 0
    requests: int = 0
    outcomes: Counter = field(default_factory=Counter)  # "200", "500", "connection ended", "no answer"
    failed_cycles: int = 0  # cycles during which some request did not get its 200
    scale_statuses: Counter = field(default_factory=Counter)  # TorchServe's answers to the scale-down calls
    concurrent_modification_errors: int = 0  # in the frontend's log
    seconds: float = 0.0

    @property
    def lost(self) -> int:
        return self.outcomes["connection ended"] + self.outcomes["no answer"]

    def as_dict(self) -> dict:
        counters = {name: dict(getattr(self, name)) for name in ("outcomes", "scale_statuses")}
        return {**{name: getattr(self, name) for name in self.__dataclass_fields__}, **counters, "lost": self.lost}


class Load:
    """``clients`` threads sending requests back to back until stopped, each outcome tagged with
    the cycle it was sent in."""

    def __init__(self, server: TorchServe, clients: int, answer_timeout_s: float = ANSWER_TIMEOUT_S):
        self.server = server
        self.clients = clients
        self.answer_timeout_s = answer_timeout_s
        self.cycle = 0
        self.results: list[tuple[int, str]] = []
        self.unanswered: Counter = Counter()  # by cycle
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(clients, thread_name_prefix="client")
        self._seed = 0
        self._lock = threading.Lock()

    def __enter__(self) -> Load:
        for _ in range(self.clients):
            self._pool.submit(self._client)
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._pool.shutdown(wait=True)

    def _client(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                self._seed += 1
                seed, cycle = self._seed, self.cycle
                self.unanswered[cycle] += 1
            outcome = self._send(seed)
            with self._lock:
                self.unanswered[cycle] -= 1
                self.results.append((cycle, outcome))

    def _send(self, seed: int) -> str:
        try:
            response = requests.post(
                self.server.predictions_url,
                json={**BODY, "seed": seed},
                headers=self.server.auth(),
                timeout=self.answer_timeout_s,
            )
        except requests.Timeout:
            return NO_STATUS[1]
        except requests.ConnectionError:
            return NO_STATUS[0]
        return str(response.status_code)


def wait_for_workers(server: TorchServe, count: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while server.worker_status() != ["READY"] * count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"not {count} READY workers within {timeout:.0f} s: {server.worker_status()}")
        time.sleep(0.2)


def scale_down(server: TorchServe, path: str, park_timeout_s: float) -> tuple[int, ...]:
    """Scale to one worker through ``path``; TorchServe's answers (the safe path asks again when
    one of several workers to be removed was removed by a failed call)."""
    if path == "raw":
        return (server.scale(1).status_code,)
    return scale(server, 1, park_timeout_s).statuses


def run_cycles(
    server: TorchServe,
    path: str,
    cycles: int,
    clients: int = 6,
    hold_s: float = 2.0,
    until_failure: bool = False,
    answer_timeout_s: float = ANSWER_TIMEOUT_S,
    progress=logger.info,
) -> CycleRun:
    """``cycles`` times (``until_failure``: at most, stopping after the first cycle in which a
    request did not get its 200): up to two workers, ``hold_s`` under load, down to one through
    ``path``."""
    run = CycleRun(path)
    log_start = server.console_log.stat().st_size
    started = time.monotonic()
    with Load(server, clients, answer_timeout_s) as load:
        for cycle in range(1, cycles + 1):
            load.cycle = cycle
            if until_failure and _waited_out_failure(load, cycle - 1, answer_timeout_s):
                break
            server.scale(2)
            wait_for_workers(server, 2)
            time.sleep(hold_s)
            try:
                run.scale_statuses.update(str(status) for status in scale_down(server, path, answer_timeout_s))
            except ScaleError as error:
                run.scale_statuses[f"refused: {error}"] += 1
            wait_for_workers(server, 1)
            time.sleep(hold_s / 2)
            run.cycles = cycle
            progress(f"{path}: cycle {cycle}/{cycles}, {len(load.results)} requests so far")
        load.cycle = cycles + 1  # the requests still running when the last cycle ended
    run.seconds = time.monotonic() - started
    failed: set[int] = set()
    for cycle, outcome in load.results:
        run.requests += 1
        run.outcomes[outcome] += 1
        if outcome != "200":
            failed.add(cycle)
    run.failed_cycles = len(failed)
    with open(server.console_log, "rb") as log:
        log.seek(log_start)
        run.concurrent_modification_errors = log.read().decode(errors="replace").count(CME)
    return run


def _waited_out_failure(load: Load, cycle: int, answer_timeout_s: float) -> bool:
    """Whether a request sent during ``cycle`` failed, waiting out those still unanswered (a lost
    one shows as "no answer" only after ``answer_timeout_s``)."""
    if cycle == 0:
        return False
    deadline = time.monotonic() + answer_timeout_s + 5
    while load.unanswered[cycle] and time.monotonic() < deadline:
        time.sleep(0.2)
    return any(outcome != "200" for sent, outcome in load.results if sent == cycle)


def dynamic_server(workdir: Path, max_batch_delay_ms: int | None = None):
    """The default model with dynamic batching, one worker to start, on a server of its own
    (``maxBatchDelay`` as shipped unless given: a longer one keeps a worker gathering a batch,
    when the race loses requests, longer)."""
    delay = {} if max_batch_delay_ms is None else {"maxBatchDelay": max_batch_delay_ms}
    config = write_model_config(workdir, continuousBatching=False, **delay)
    return serve_archive(DEFAULT_MODEL_DIR, config, workdir, gpus=1)


def write_report(runs: list[CycleRun], output: Path, command: str) -> None:
    output.mkdir(parents=True, exist_ok=True)
    (output / "outcomes.json").write_text(json.dumps([run.as_dict() for run in runs], indent=2))
    failures = sorted({kind for run in runs for kind in run.outcomes if kind != "200"})
    figure, axis = plt.subplots(figsize=(7, 3.5))
    labels = [f"{run.path}\n{run.cycles} cycle(s), {run.requests} requests" for run in runs]
    bottom = [0] * len(runs)
    for kind in failures:
        counts = [run.outcomes[kind] for run in runs]
        axis.bar(labels, counts, bottom=bottom, label=kind if kind in NO_STATUS else f"HTTP {kind}")
        bottom = [below + count for below, count in zip(bottom, counts, strict=True)]
    for index, total in enumerate(bottom):
        axis.annotate(str(total), (index, total), ha="center", va="bottom")
    axis.set_ylabel("requests without their 200")
    axis.set_title("Requests failed while scaling 1 -> 2 -> 1 workers under load")
    if failures:
        axis.legend()
    figure.tight_layout()
    figure.savefig(output / "outcomes.png", dpi=120)
    lines = [
        "# Scale-down under load",
        "",
        f"`{command}`, {time.strftime('%Y-%m-%d')}.",
        "",
        "| path | cycles | requests | 200 | other status | connection ended | no answer | cycles with a failure | "
        "scale-down answers | ConcurrentModificationException |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        other = run.requests - run.outcomes["200"] - run.lost
        lines.append(
            f"| {run.path} | {run.cycles} | {run.requests} | {run.outcomes['200']} | {other} | "
            f"{run.outcomes['connection ended']} | {run.outcomes['no answer']} | {run.failed_cycles} | "
            f"{dict(run.scale_statuses)} | {run.concurrent_modification_errors} |"
        )
    (output / "report.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--path", choices=PATHS, action="append", help="raw, safe or both (the default)")
    parser.add_argument("--max-batch-delay", type=int, help="maxBatchDelay in ms [packaging's for dynamic batching]")
    parser.add_argument("--output", type=Path, default=REPORTS / "scaling")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    workdir = BUILD / "scale-cycles"
    workdir.mkdir(parents=True, exist_ok=True)
    runs = []
    with dynamic_server(workdir, args.max_batch_delay) as server:
        for path in args.path or PATHS:  # raw until its first failing cycle: a lost request holds its client
            runs.append(run_cycles(server, path, args.cycles, args.clients, until_failure=path == "raw"))
    command = f"python -m loadtest.scale_cycles --cycles {args.cycles} --clients {args.clients}"
    if args.max_batch_delay is not None:
        command += f" --max-batch-delay {args.max_batch_delay}"
    write_report(runs, args.output, command)
    print((args.output / "report.md").read_text())


if __name__ == "__main__":
    main()
