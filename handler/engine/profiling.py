"""Where a run of denoising steps spends its time, from ``torch.profiler``: on CUDA the kernels'
share of the wall time (the rest is launch gaps, host synchronization and the host's own work
between forwards), the host synchronizations and kernel launches per step, and the kernels taking
the most time; on a CPU the operators taking the most CPU time. ``summarize`` reads a finished
profile (``make bench-gpu`` profiles a call in-process); ``StepsProfiler`` profiles a window of a
worker's served steps (``handler.profiler``), the work between them included."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from handler.engine.loading import synchronize

logger = logging.getLogger(__name__)

# The runtime and driver calls that launch a kernel (a CUDA graph's replay launches its kernels in one call).
KERNEL_LAUNCHES = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch"}


def activities(device: torch.device) -> list[torch.profiler.ProfilerActivity]:
    """What to record on ``device``: the host's operators, and on CUDA its kernels."""
    cuda = [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else []
    return [torch.profiler.ProfilerActivity.CPU, *cuda]


def busy_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """The seconds at least one of ``intervals`` (start and end, in microseconds) covers: the
    device's busy time where kernels of several streams overlap (the decode's, the safety
    checker's, the step's), counted once."""
    busy, reached = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end > reached:
            busy += end - max(start, reached)
            reached = end
    return busy / 1e6


def _on_the_device(event: Any) -> bool:
    """A kernel or copy the device ran (not a user annotation projected onto it)."""
    return event.device_type == torch.autograd.DeviceType.CUDA and not getattr(event, "is_user_annotation", False)


def summarize(profiler: torch.profiler.profile, device: torch.device, wall_s: float, steps: int, top: int = 8) -> dict:
    """A finished profile of ``steps`` steps that took ``wall_s`` seconds (unprofiled, where the
    caller measured that apart): the operators taking the most time and, on CUDA, the seconds a
    kernel (or copy) ran and their share of ``wall_s`` (overlaps counted once), the host syncs (by
    call) and the syncs and kernel launches per step."""
    events = profiler.key_averages()
    cuda = device.type == "cuda"
    if cuda:  # kernel rows only: a CPU operator's self device time repeats its kernels'
        timed = [(event, event.self_device_time_total) for event in events if _on_the_device(event)]
    else:
        timed = [(event, event.self_cpu_time_total) for event in events]
    ranked = sorted((pair for pair in timed if pair[1] > 0), key=lambda pair: pair[1], reverse=True)
    result: dict[str, Any] = {
        "wall_s": wall_s,
        "steps": steps,
        "measure": "kernel time" if cuda else "self CPU time",
        "top_operators": [
            {"name": event.key, "calls": event.count, "seconds": seconds / 1e6} for event, seconds in ranked[:top]
        ],
    }
    if cuda:
        kernel_s = busy_seconds(
            (event.time_range.start, event.time_range.end) for event in profiler.events() if _on_the_device(event)
        )
        syncs = {event.key: event.count for event in events if "Synchronize" in event.key}
        launches = sum(event.count for event in events if event.key in KERNEL_LAUNCHES)
        result |= {
            "device_busy_s": kernel_s,
            "device_busy_fraction": kernel_s / wall_s,
            "host_syncs": syncs,
            "syncs_per_step": sum(syncs.values()) / steps,
            "launches_per_step": launches / steps,
        }
    return result


class StepsProfiler:
    """Profiles ``steps`` consecutive denoiser forwards of a worker, once: the first forward of at
    least ``min_rows`` rows opens the window, the end of the ``steps``-th closes it (the device's
    work waited for), so the window holds the served loop's work between them (admission, decoding,
    encoding, answers, TorchServe's calls). The summary is logged and, with ``directory``, written
    to ``step-profile-<pid>.json`` there."""

    def __init__(self, device: torch.device, steps: int, min_rows: int, directory: str | None):
        self.device = device
        self.steps = steps
        self.min_rows = min_rows
        self.directory = directory
        self._profiler: torch.profiler.profile | None = None
        self._started = 0.0
        self._profiled = 0
        self._rows = 0
        self.summary: dict | None = None  # once the window has closed

    def before(self, rows: int) -> None:
        """A forward of ``rows`` rows is about to run."""
        if self.summary is not None:
            return
        if self._profiler is None:
            if rows < self.min_rows:
                return
            self._profiler = torch.profiler.profile(activities=activities(self.device))
            if not self._guarded("start", self._profiler.start):
                return
            self._started = time.perf_counter()
        self._rows += rows

    def after(self) -> None:
        """The forward announced by ``before`` was queued (or failed)."""
        if self._profiler is None or self.summary is not None:
            return
        self._profiled += 1
        if self._profiled == self.steps:
            self._guarded("close", self._close)

    def _close(self) -> None:
        assert self._profiler is not None
        synchronize(self.device)  # the window's last kernels in it
        wall_s = time.perf_counter() - self._started
        self._profiler.stop()
        self.summary = summarize(self._profiler, self.device, wall_s, self._profiled) | {
            "rows_per_step": self._rows / self._profiled,
            "device": str(self.device),
        }
        self._profiler = None
        logger.info(
            "step profile: %d forwards of %.1f rows in %.3f s%s",
            self._profiled,
            self.summary["rows_per_step"],
            wall_s,
            ""
            if "device_busy_fraction" not in self.summary
            else f", kernels {self.summary['device_busy_fraction']:.1%} of it, "
            f"{self.summary['syncs_per_step']:.1f} syncs and {self.summary['launches_per_step']:.0f} launches a step",
        )
        if self.directory:
            self._write(Path(self.directory) / f"step-profile-{os.getpid()}.json")

    def _guarded(self, what: str, action: Callable[[], None]) -> bool:
        """``action``; where it fails, the profiler is off for good (logged), the forwards go on."""
        try:
            action()
            return True
        except Exception:
            logger.exception("step profile: %s failed; the worker profiles no more", what)
            self.summary, self._profiler = {"error": what}, None
            return False

    def _write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".json.partial")
        partial.write_text(json.dumps(self.summary, indent=2))
        partial.replace(path)  # readers never see half a file
