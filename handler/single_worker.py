"""One continuous-batching worker per model: a lock the workers of one model registration share.

TorchServe 0.12 serves continuous batching correctly with one worker per model only: an idle worker
waits for a request while holding the model's lock (``Model.pollInferJob``), so a second worker
stalls the first one's requests in flight until a new request arrives. Packaging ships one worker
with continuous batching, but the management API can add one (``PUT /models/NAME?min_worker=2``).

So the first worker takes an exclusive ``flock`` on a file of the model's registration: TorchServe
unpacks an archive once per registration into a directory of its own (a no-archive model directory
is a symbolic link in such a directory) and hands every worker of the model that path. A second
worker cannot take the lock and refuses to load, naming continuous batching and how to switch
modes, while the first keeps serving. The kernel releases the lock when its process dies, however
it dies, so the worker TorchServe starts in its place takes it.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

LOCK_FILE = ".continuous-batching-worker.lock"


class SecondWorkerError(RuntimeError):
    """Another worker of this model already serves continuous batching."""


def lock_path(model_dir: str | Path) -> Path:
    """The lock file of the registration whose unpacked directory (or link) is ``model_dir``."""
    path = Path(model_dir)
    return (path.parent if path.is_symlink() else path) / LOCK_FILE


def claim(model_dir: str | Path, model_name: str) -> int | None:
    """Take this registration's continuous-batching lock for the life of the process; return the
    open descriptor that holds it (None where no lock file can be made, logged). Raises
    ``SecondWorkerError`` when another worker holds it."""
    path = lock_path(model_dir)
    try:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as error:
        logger.warning(
            "no continuous-batching worker lock at %s (%s): a second worker would not be refused", path, error
        )
        return None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise SecondWorkerError(
            f"{model_name} runs continuous batching, and another worker of it is already serving: TorchServe 0.12 "
            "serves continuous batching with one worker per model (a second one would stall the first one's "
            "requests in flight), so this worker refuses to load while the first keeps serving. Scale back to one "
            f"worker (PUT /models/{model_name}?min_worker=1&max_worker=1), or, for several workers, switch to dynamic "
            "batching: set continuousBatching: false in model-config.yaml and rebuild the archive (make mar)"
        ) from None
    os.ftruncate(descriptor, 0)
    os.write(descriptor, f"{os.getpid()}\n".encode())
    return descriptor
