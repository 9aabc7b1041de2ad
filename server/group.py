"""Stopping a process and its process group: each signal in turn until the group is gone.

Standard library only: ``bench.gpu_calls`` stops its steps with it on a GPU host before the carried
packages are installed, as ``server.process.TorchServe`` stops TorchServe.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence

logger = logging.getLogger("server")

TERMINATE_SECONDS = 60  # after SIGTERM, how long the frontend and workers get to exit before SIGKILL
KILL_SECONDS = 10  # after SIGKILL, how long the group's processes get to be gone


def stop_group(process: subprocess.Popen, signals: Sequence[tuple[signal.Signals, float]], name: str) -> None:
    """Send the process group led by ``process`` each signal in turn, waiting up to its seconds for
    the process and every other process of the group to exit, then SIGKILL whatever is left."""
    for sig, wait in (*signals, (signal.SIGKILL, KILL_SECONDS)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        try:
            process.wait(timeout=wait)
            wait_group_gone(process.pid, deadline - time.monotonic())
            return
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop within %.0f s after %s", name, wait, sig.name)


def wait_group_gone(pgid: int, timeout: float) -> None:
    """Wait until no process of the group is left (workers may outlive the frontend briefly)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    raise subprocess.TimeoutExpired(f"process group {pgid}", timeout)
