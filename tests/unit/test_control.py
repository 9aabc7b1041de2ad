"""The control directory between the server process and its workers: what the server writes
(server/control.py) is what a worker reads (handler/control.py); the stop's default grace period
follows the handler's request time limit."""

from __future__ import annotations

import threading
import time

import pytest

from handler import config as handler_config
from handler import control as worker_side
from handler.config import HandlerSettings
from server import control as server_side
from server import process
from server.control import ControlDir
from server.healthcheck import ping
from server.properties import EFFECTIVE_CONFIG
from server.scaling import scale


def test_both_sides_name_the_same_variable_and_files():
    for name in ("CONTROL_DIR_ENV", "DRAINING", "RETIRING", "PARKED_PREFIX"):
        assert getattr(worker_side, name) == getattr(server_side, name), name


def test_a_drain_tells_every_worker_the_seconds_left_until_a_new_server_starts(tmp_path):
    server = ControlDir.of(tmp_path)
    server.reset()
    worker = worker_side.Control(server.path, "9000")
    assert worker.drain_seconds_left() is None
    drain = server.begin_drain(grace_s=100.0, answer_margin_s=5.0)
    assert drain["deadline"] == pytest.approx(drain["started"] + 95.0)
    assert worker.drain_seconds_left() == pytest.approx(95.0, abs=1.0)
    server.reset()
    assert worker.drain_seconds_left() is None


def test_no_control_directory_signals_nothing():
    worker = worker_side.Control(None, "9000")
    assert worker.drain_seconds_left() is None and not worker.retiring()


def test_only_the_listed_workers_retire_until_it_expires(tmp_path):
    server = ControlDir.of(tmp_path)
    server.retire(["9001"], expires_s=2.0)  # long enough for a slow machine to read it in time
    assert worker_side.Control(server.path, "9001").retiring()
    assert not worker_side.Control(server.path, "9000").retiring()
    time.sleep(2.1)
    assert not worker_side.Control(server.path, "9001").retiring()


def test_a_retiring_worker_parks_until_the_retirement_ends(tmp_path):
    server = ControlDir.of(tmp_path)
    server.retire(["9001"], expires_s=60)
    worker = worker_side.Control(server.path, "9001")
    parked: list[float] = []
    thread = threading.Thread(target=lambda: parked.append(worker.park(longest_s=60)))
    thread.start()
    deadline = time.monotonic() + 10
    while server.parked() != {"9001"}:
        assert time.monotonic() < deadline, "the worker did not mark itself parked"
        time.sleep(0.01)
    assert thread.is_alive()
    server.end_retirement()
    thread.join(timeout=10)
    assert not thread.is_alive() and parked[0] > 0 and server.parked() == set()


def test_a_parked_worker_gives_up_after_its_longest_park(tmp_path):
    server = ControlDir.of(tmp_path)
    server.retire(["9001"], expires_s=60)
    assert 0.2 <= worker_side.Control(server.path, "9001").park(longest_s=0.2) < 1.0
    assert server.parked() == set()


def test_a_control_file_is_read_again_when_it_changes(tmp_path):
    server = ControlDir.of(tmp_path)
    worker = worker_side.Control(server.path, "9001")
    server.retire(["9000"], expires_s=60)
    assert not worker.retiring()
    time.sleep(0.01)
    server.retire(["9000", "9001"], expires_s=60)
    assert worker.retiring()


@pytest.mark.parametrize(
    "model_config",
    [{}, {"responseTimeout": 300}, {"responseTimeout": 300, "handler": {"request_timeout_s": 42}}],
)
def test_the_default_stop_grace_covers_the_handlers_request_time_limit(model_config):
    limit = HandlerSettings.from_model_yaml(model_config).request_timeout_s
    assert process.request_time_limit(model_config) == limit
    assert process.default_stop_grace(model_config) == limit + process.ANSWER_MARGIN_SECONDS
    assert process.TORCHSERVE_RESPONSE_TIMEOUT == handler_config.TORCHSERVE_RESPONSE_TIMEOUT
    assert process.REQUEST_TIMEOUT_SHARE == handler_config.REQUEST_TIMEOUT_SHARE


def test_the_health_check_fails_from_the_moment_a_stop_begins(tmp_path):
    (tmp_path / EFFECTIVE_CONFIG).write_text("inference_address=http://127.0.0.1:1\n")
    ControlDir.of(tmp_path).begin_drain(grace_s=10.0, answer_margin_s=1.0)
    healthy, message = ping(tmp_path, timeout=1.0)
    assert not healthy and "stopping" in message


class FakeServer:
    """Stands in for ``TorchServe`` in a scale-down: its workers take describe calls in turn; a
    retiring one parks in it (as handler/control.py does) until the retirement ends."""

    model_url = "http://127.0.0.1:1/models/stable-diffusion"
    model_name = "stable-diffusion"

    def __init__(self, workdir, workers: list[str], racing_calls: int = 0, unparked_by_race: tuple[str, ...] = ()):
        self.control = ControlDir.of(workdir)
        self.control.reset()
        self.workers = workers
        self.turn = 0
        self.lock = threading.Lock()
        self.racing_calls = racing_calls  # scale calls that TorchServe's shutdown race fails (see scale)
        self.unparked_by_race = unparked_by_race
        self.scale_calls: list[tuple[int, set[str]]] = []  # (workers listed, workers parked) at each

    def describe(self) -> dict:
        workers = [{"id": worker, "status": "READY"} for worker in self.workers]
        return {"continuousBatching": False, "workers": workers}

    def management(self, method, url, **kwargs):
        with self.lock:
            worker = self.workers[self.turn % len(self.workers)]
            self.turn += 1
        control = worker_side.Control(self.control.path, worker)
        if control.retiring():
            control.park(longest_s=30)

    def scale(self, workers: int):
        self.scale_calls.append((len(self.workers), self.control.parked()))
        assert self.control.parked() == set(self.workers[workers:]), "a worker removed while not parked"
        if self.racing_calls:  # the last worker is removed, its shutdown throws: the rest stay
            self.racing_calls -= 1
            self.workers = self.workers[:-1]
            for worker in self.unparked_by_race:  # as if it outlasted its longest park meanwhile
                (self.control.path / f"{server_side.PARKED_PREFIX}{worker}").unlink(missing_ok=True)
            return type("Answer", (), {"status_code": 500, "text": "ConcurrentModificationException"})()
        self.workers = self.workers[:workers]
        return type("Answer", (), {"status_code": 200, "text": ""})()


def test_scaling_down_parks_every_worker_to_be_removed_before_the_scale_call(tmp_path):
    server = FakeServer(tmp_path, ["9000", "9001", "9002", "9003"])
    result = scale(server, 1, park_timeout_s=20)
    assert (result.before, result.after, result.status) == (4, 1, 200)
    assert server.scale_calls == [(4, {"9001", "9002", "9003"})]
    assert server.workers == ["9000"] and server.control.parked() == set()


def test_a_scale_call_the_shutdown_race_failed_is_sent_again_once_the_rest_are_parked(tmp_path):
    server = FakeServer(tmp_path, ["9000", "9001", "9002", "9003"], racing_calls=2, unparked_by_race=("9001",))
    result = scale(server, 1, park_timeout_s=20)
    assert (result.before, result.after, result.statuses) == (4, 1, (500, 500, 200))
    assert server.scale_calls == [(4, {"9001", "9002", "9003"}), (3, {"9001", "9002"}), (2, {"9001"})]
    assert server.workers == ["9000"] and server.control.parked() == set()


def test_a_failed_scale_call_that_reached_the_count_is_not_sent_again(tmp_path):
    server = FakeServer(tmp_path, ["9000", "9001"], racing_calls=1)
    result = scale(server, 1, park_timeout_s=20)
    assert (result.after, result.statuses, len(server.scale_calls)) == (1, (500,), 1)
