"""What the server process tells its workers through files in its control directory.

TorchServe 0.12 gives a server process no channel to a worker's handler, so ``server.cli`` writes
small JSON files into a directory it names in every worker's environment (``SD_CONTROL_DIR``), and
the workers read them (a ``stat`` per iteration; the file is parsed only when it changed):

- ``draining``: the server is stopping (SIGTERM/SIGINT, ``make stop``, a Kubernetes ``preStop``).
  A worker admits no new request (503 with ``Retry-After``) and cancels what would still be
  denoising at ``deadline`` (seconds since the epoch) with a 503, so that every request is answered
  before TorchServe stops.
- ``retiring``: ``python -m server.cli scale`` is about to remove the workers listed in ``workers``.
  Such a worker, given a describe call (``GET /models/NAME?customized=true``), which TorchServe
  never batches with a request, holds it ("parks", marking ``parked-<worker>``) until it is removed
  or ``expires`` passes: a parked worker has no request in flight when TorchServe shuts it down.

The file names and the variable are the server's too (``server/control.py``); a unit test keeps
them equal.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CONTROL_DIR_ENV = "SD_CONTROL_DIR"
DRAINING = "draining"
RETIRING = "retiring"
PARKED_PREFIX = "parked-"
PARK_POLL_S = 0.05


class ControlFile:
    """One JSON file of the control directory, read again only when it changed."""

    def __init__(self, path: Path):
        self.path = path
        self._stamp: tuple[int, int, int] | None = None
        self._content: dict[str, Any] | None = None

    def read(self) -> dict[str, Any] | None:
        """The file's content; None while it does not exist (or is not yet whole)."""
        try:
            stat = self.path.stat()
        except OSError:
            self._stamp, self._content = None, None
            return None
        stamp = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if stamp != self._stamp:
            try:
                content = json.loads(self.path.read_text())
            except (OSError, ValueError):
                return None  # being replaced: read it again next time
            self._stamp, self._content = stamp, content if isinstance(content, dict) else None
        return self._content


class Control:
    """This worker's view of the control directory (none: nothing is ever signalled)."""

    def __init__(self, directory: str | Path | None, worker: str):
        self.directory = Path(directory) if directory else None
        self.worker = worker
        self._draining = ControlFile(self.directory / DRAINING) if self.directory else None
        self._retiring = ControlFile(self.directory / RETIRING) if self.directory else None

    @classmethod
    def from_environment(cls, worker: str) -> Control:
        return cls(os.environ.get(CONTROL_DIR_ENV), worker)

    def drain_seconds_left(self) -> float | None:
        """While the server is stopping, the seconds left to answer every request; else None."""
        content = self._draining.read() if self._draining else None
        return None if content is None else float(content["deadline"]) - time.time()

    def retiring(self) -> bool:
        """Whether the server is about to remove this worker."""
        content = self._retiring.read() if self._retiring else None
        return content is not None and self.worker in content.get("workers", []) and time.time() < content["expires"]

    def park(self, longest_s: float) -> float:
        """Hold this (retiring) worker until it is no longer retiring (removed, or the scale-down
        given up) or ``longest_s`` passed; returns the seconds parked."""
        assert self.directory is not None
        started = time.monotonic()
        marker = self.directory / f"{PARKED_PREFIX}{self.worker}"
        marker.write_text(json.dumps({"pid": os.getpid()}))
        logger.info("worker %s parked: the server is removing it", self.worker)
        try:
            while self.retiring() and time.monotonic() - started < longest_s:
                time.sleep(PARK_POLL_S)
        finally:
            marker.unlink(missing_ok=True)
        return time.monotonic() - started
