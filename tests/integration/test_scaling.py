"""Scaling workers down under load on a real TorchServe (dynamic batching, the mode several workers
run): the project's safe path (``python -m server.cli scale``) answers every request 200, cycle
after cycle; how often TorchServe 0.12's raw scale-down loses requests is measured and reported (the
race strikes some days and not others: a measurement, not a check); a continuous-batching model is
never scaled beyond its one worker."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from loadtest.scale_cycles import dynamic_server, run_cycles, wait_for_workers
from server import ScaleError, TorchServe, scale
from server.paths import ROOT
from tests.harness.serving import Client

SAFE_CYCLES = 2
# A worker gathers a batch for up to maxBatchDelay, when the race loses requests most: at 500 ms it
# showed in 3 of 4 cycles here, at the shipped 50 ms in 3 of 20 (docs/reliability.md).
MAX_BATCH_DELAY_MS = 500
RAW_CYCLES = 1
ANSWER_TIMEOUT_S = 30  # a request of 8 steps takes about a second here: unanswered this long is lost
# The raw cycles are a measurement: a request unanswered this long counts as lost in their report.
RAW_ANSWER_TIMEOUT_S = 10


@pytest.fixture(scope="module")
def dynamic(tmp_path_factory) -> Iterator[TorchServe]:
    """Its workers wait for work in OpenMP without spinning: on a 2-core machine a second worker's
    warm-up and the serving worker, each spinning on the cores the other needs, held requests past
    ``ANSWER_TIMEOUT_S`` (docs/benchmarks.md, 2026-12-07)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # the server's environment, read when TorchServe is made
        with dynamic_server(tmp_path_factory.mktemp("scaling"), MAX_BATCH_DELAY_MS) as server:
            yield server


def test_the_safe_path_answers_every_request_while_scaling_down_under_load(dynamic):
    run = run_cycles(dynamic, "safe", SAFE_CYCLES, answer_timeout_s=ANSWER_TIMEOUT_S)
    assert run.cycles == SAFE_CYCLES and run.requests > 10 * SAFE_CYCLES
    assert dict(run.outcomes) == {"200": run.requests}, dict(run.outcomes)
    # TorchServe's race can still strike the parked describe call: the scale call then answers 500,
    # having removed the worker all the same (server/scaling.py); none is refused
    assert set(run.scale_statuses) <= {"200", "500"} and run.scale_statuses.total() == SAFE_CYCLES
    assert dynamic.worker_status() == ["READY"]


def test_torchserves_raw_scale_down_under_load_is_measured_and_the_server_keeps_serving(dynamic, record_property):
    """The race the safe path avoids, as a measurement: how many of ``RAW_CYCLES`` raw scale-downs
    lost or failed a request (it struck in 3 of 4 cycles at 500 ms here one day, in none of 20 on
    another). Whatever it struck, the server answers the next request."""
    run = run_cycles(dynamic, "raw", RAW_CYCLES, hold_s=1.0, answer_timeout_s=RAW_ANSWER_TIMEOUT_S)
    struck = f"{run.failed_cycles} of {run.cycles} raw scale-downs lost or failed a request: {dict(run.outcomes)}"
    record_property("raw_scale_down", struck)
    print(struck)
    assert run.cycles == RAW_CYCLES and run.requests > 0
    assert set(run.outcomes) <= {"200", "500", "connection ended", "no answer"}, dict(run.outcomes)
    wait_for_workers(dynamic, 1)
    assert Client(dynamic).predict({"prompt": "still serving", "num_inference_steps": 4}).status_code == 200


def test_the_scale_command_scales_the_server_running_from_a_working_directory(dynamic):
    command = [sys.executable, "-m", "server.cli", "scale", "--workdir", str(dynamic.workdir)]
    up = subprocess.run([*command[:4], "2", *command[4:]], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert up.returncode == 0, up.stderr
    wait_for_workers(dynamic, 2)
    down = subprocess.run([*command[:4], "1", *command[4:]], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert down.returncode == 0 and "workers: 2 -> 1" in down.stderr, down.stderr
    assert dynamic.worker_status() == ["READY"]


def test_a_continuous_batching_model_is_not_scaled_beyond_one_worker(server):
    before = server.describe()["workers"]
    with pytest.raises(ScaleError, match="continuous batching"):
        scale(server, 2, park_timeout_s=10)
    assert server.describe()["workers"] == before
