"""Packaging and running the server: everything outside the archive that TorchServe needs.

- ``paths``: the repository's root and shared files, defined once.
- ``archive``: handler + pipeline + model-config.yaml -> ``stable-diffusion.mar`` (``make mar``).
- ``properties``: config.properties, listeners, keys, free loopback ports.
- ``process``: one TorchServe in its own process group: start, wait for a ready worker, drain, stop.
- ``group``: stopping a process group, signal by signal (standard library only).
- ``control``: the files the server process tells its workers through (a stop's drain, a scale-down).
- ``scaling``: setting the worker count without losing a request (``python -m server.cli scale``).
- ``cli``: ``make serve`` in the foreground (run by ``start.sh``, which the container runs too),
  ``stop`` and ``scale``.
- ``healthcheck``: /ping with the key read from the working directory (Docker, Kubernetes); fails
  while the server stops.
- ``image``: the serving image, docker/Dockerfile, built with docker or buildah (``make image``).

The model makers, observability tools, load tests and benchmarks use the names below and nothing
else of this package (``tests/unit/test_layout.py`` keeps it so). They are imported on first use, so
that ``python -m server.archive`` (and the other commands) run their module once, not first as a
side effect of importing the package.
"""

from __future__ import annotations

import importlib
from typing import Any

# Each entry point and the module that defines it.
_HOMES = {
    "KEY_FILE": "server.properties",
    "Addresses": "server.properties",
    "Keys": "server.properties",
    "config_on_free_ports": "server.properties",
    "free_port": "server.properties",
    "read_properties": "server.properties",
    "PortInUse": "server.process",
    "again_on_taken_port": "server.process",
    "TorchServe": "server.process",
    "serve_archive": "server.process",
    "start_on_free_ports": "server.process",
    "stop_group": "server.group",
    "build": "server.archive",
    "console_script": "server.archive",
    "write_model_config": "server.archive",
    "merged_model_config": "server.archive",
    "serving_defaults": "server.archive",
    "visible_gpus": "server.archive",
    "scale": "server.scaling",
    "ScaleError": "server.scaling",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    """An entry point, imported from its module on first use."""
    if name not in _HOMES:
        raise AttributeError(f"module 'server' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
