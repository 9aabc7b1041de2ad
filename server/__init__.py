"""Packaging and running the server: everything outside the archive that TorchServe needs.

- ``paths``: the repository's root and shared files, defined once.
- ``archive``: handler + pipeline + model-config.yaml -> ``stable-diffusion.mar`` (``make mar``).
- ``properties``: config.properties, listeners, keys, free loopback ports.
- ``process``: one TorchServe in its own process group: start, wait for a ready worker, stop.
- ``cli``: ``make serve`` in the foreground (run by ``start.sh``, which the container runs too).
- ``healthcheck``: /ping with the key read from the working directory (Docker, Kubernetes).
- ``image``: the serving image, docker/Dockerfile, built with docker or buildah (``make image``).

The model makers, observability tools, load tests and benchmarks use the names below and nothing
else of this package (``tests/unit/test_layout.py`` keeps it so). They are imported on first use, so
that ``python -m server.archive`` (and the other commands) run their module once, not first as a
side effect of importing the package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from server.archive import build, console_script, write_model_config
    from server.process import TorchServe, serve_archive
    from server.properties import KEY_FILE, Addresses, Keys, config_on_free_ports, free_port, read_properties

__all__ = [
    "KEY_FILE",
    "Addresses",
    "Keys",
    "TorchServe",
    "build",
    "config_on_free_ports",
    "console_script",
    "free_port",
    "read_properties",
    "serve_archive",
    "write_model_config",
]
_HOMES = ("server.properties", "server.process", "server.archive")


def __getattr__(name: str) -> Any:
    """An entry point, imported from its module on first use."""
    if name in __all__:
        for home in map(importlib.import_module, _HOMES):
            if hasattr(home, name):
                return getattr(home, name)
    raise AttributeError(f"module 'server' has no attribute {name!r}")
