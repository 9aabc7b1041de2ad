"""Step times without waiting for the device: on CUDA, an event recorded on the device's stream
before and after each step, read once the device has passed the second (``collect``); elsewhere
the host's clock, the work being done when the call returns."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch


class StepTimer:
    """Times steps on ``device`` and hands each time, in seconds, to the step's callback."""

    def __init__(self, device: torch.device):
        self.device = device
        self._pending: deque[tuple[Any, Any, Callable[[float], None]]] = deque()

    def start(self) -> Any:
        """A mark before a step: a recorded CUDA event, or the host's clock."""
        if self.device.type != "cuda":
            return time.perf_counter()
        return self._event()

    def stop(self, started: Any, done: Callable[[float], None]) -> None:
        """A mark after the step begun at ``started``: ``done(seconds)`` now on the host's clock, on
        CUDA once the device has run the step (this or a later ``collect``)."""
        if self.device.type != "cuda":
            done(time.perf_counter() - started)
            return
        self._pending.append((started, self._event(), done))
        self.collect()

    def collect(self, wait: bool = False) -> None:
        """Hand over the times of the steps the device has finished (``wait``: of all of them)."""
        while self._pending:
            started, ended, done = self._pending[0]
            if not wait and not ended.query():
                return
            self._pending.popleft()  # before reading it: a device error is raised once
            if wait:
                ended.synchronize()
            done(started.elapsed_time(ended) / 1000)

    def _event(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event
