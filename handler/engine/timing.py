"""Device work timed without waiting for the device: on CUDA, an event recorded on the device's
stream before and after the work, read once the device has passed the second; elsewhere the
host's clock, the work being done when the call returns. ``StepTimer`` times steps that way,
``Span`` one piece of work read later (a decode whose images are made on an encoder thread)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch


def mark(device: torch.device) -> Any:
    """A point in ``device``'s work: a recorded CUDA event, or the host's clock."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True, blocking=True)  # a wait for it yields the CPU
    event.record(torch.cuda.current_stream(device))
    return event


def seconds_between(started: Any, ended: Any) -> float:
    """The seconds between two marks of one device; on CUDA once the device has passed ``ended``
    (waited for here)."""
    if isinstance(started, float):
        return ended - started
    ended.synchronize()
    return started.elapsed_time(ended) / 1000


class Span:
    """Work queued on ``device`` between its creation and ``end``; ``seconds`` waits for it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.started = mark(device)
        self.ended: Any = None

    def end(self) -> Span:
        self.ended = mark(self.device)
        return self

    def seconds(self) -> float:
        """The work's seconds, once the device has done it (waited for here)."""
        return seconds_between(self.started, self.ended)


class StepTimer:
    """Times steps on ``device`` and hands each time, in seconds, to the step's callback."""

    def __init__(self, device: torch.device):
        self.device = device
        self._pending: deque[tuple[Any, Any, Callable[[float], None]]] = deque()

    def start(self) -> Any:
        """A mark before a step."""
        return mark(self.device)

    def stop(self, started: Any, done: Callable[[float], None]) -> None:
        """A mark after the step begun at ``started``: ``done(seconds)`` now on the host's clock, on
        CUDA once the device has run the step (this or a later ``collect``)."""
        ended = mark(self.device)
        if isinstance(ended, float):
            done(ended - started)
            return
        self._pending.append((started, ended, done))
        self.collect()

    def collect(self, wait: bool = False) -> None:
        """Hand over the times of the steps the device has finished (``wait``: of all of them)."""
        while self._pending:
            started, ended, done = self._pending[0]
            if not wait and not ended.query():
                return
            self._pending.popleft()  # before reading it: a device error is raised once
            done(seconds_between(started, ended))
