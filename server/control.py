"""The server's side of the control directory its workers read (``handler/control.py`` says what
each file means to a worker): the stop's drain and the scale-down's retirement.

Files are written whole (a temporary file renamed into place), so a worker never reads half of one.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

# The same names as handler/control.py's (the handler cannot import this package); a unit test
# keeps them equal.
CONTROL_DIR_ENV = "SD_CONTROL_DIR"
DRAINING = "draining"
RETIRING = "retiring"
PARKED_PREFIX = "parked-"


class ControlDir:
    """The control directory of one server's working directory."""

    def __init__(self, path: Path):
        self.path = path

    @classmethod
    def of(cls, workdir: Path) -> ControlDir:
        """The control directory of the server running from ``workdir``."""
        return cls(workdir / "control")

    def reset(self) -> None:
        """Empty it: a new server starts with nothing signalled."""
        self.path.mkdir(parents=True, exist_ok=True)
        for stale in self.path.iterdir():
            stale.unlink(missing_ok=True)

    def _write(self, name: str, content: dict[str, Any]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        partial = self.path / f".{name}.partial"
        partial.write_text(json.dumps(content))
        os.replace(partial, self.path / name)

    def _read(self, name: str) -> dict[str, Any] | None:
        try:
            return json.loads((self.path / name).read_text())
        except (OSError, ValueError):
            return None

    def begin_drain(self, grace_s: float, answer_margin_s: float) -> dict[str, Any]:
        """Tell the workers that the server is stopping: requests still denoising
        ``answer_margin_s`` before the grace period ends are cancelled then, so that their
        answers leave before TorchServe stops. Returns the drain (``started``, ``ends``,
        ``deadline``, epoch seconds)."""
        started = time.time()
        drain = {"started": started, "ends": started + grace_s, "deadline": started + max(grace_s - answer_margin_s, 0)}
        self._write(DRAINING, drain)
        return drain

    def drain(self) -> dict[str, Any] | None:
        """The drain under way, or None."""
        return self._read(DRAINING)

    def retire(self, workers: list[str], expires_s: float) -> None:
        """Tell ``workers`` to park in their next describe call, for at most ``expires_s`` from now
        (markers of workers no longer listed are dropped)."""
        for marker in self.path.glob(f"{PARKED_PREFIX}*"):
            if marker.name.removeprefix(PARKED_PREFIX) not in workers:
                marker.unlink(missing_ok=True)
        self._write(RETIRING, {"workers": workers, "expires": time.time() + expires_s})

    def parked(self) -> set[str]:
        """The workers parked now."""
        return {path.name.removeprefix(PARKED_PREFIX) for path in self.path.glob(f"{PARKED_PREFIX}*")}

    def end_retirement(self) -> None:
        """Release parked workers (those still running) and forget the retirement."""
        (self.path / RETIRING).unlink(missing_ok=True)
        for marker in self.path.glob(f"{PARKED_PREFIX}*"):
            marker.unlink(missing_ok=True)
