"""Rewrite the generated files from their builders (a unit test checks each committed one).

python -m observability.generate [NAME ...]   # make dashboard / prometheus-rule / metrics-config
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from pathlib import Path

from observability import build_dashboard, build_metrics_config, build_prometheus_rule
from server.paths import METRICS_CONFIG, ROOT

logger = logging.getLogger("generate")

# Name -> (the committed file, its builder).
GENERATED: dict[str, tuple[Path, Callable[[], str]]] = {
    "dashboard": (build_dashboard.OUTPUT, build_dashboard.render),
    "prometheus-rule": (build_prometheus_rule.OUTPUT, build_prometheus_rule.render),
    "metrics-config": (METRICS_CONFIG, build_metrics_config.render),
}


def is_current(name: str) -> bool:
    """Whether the committed file is what its builder makes."""
    path, render = GENERATED[name]
    return path.read_text() == render()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"some of {', '.join(GENERATED)} [all]")
    args = parser.parse_args()
    names = args.names or list(GENERATED)
    if unknown := set(names) - set(GENERATED):
        parser.error(f"unknown {sorted(unknown)}; choose from {', '.join(GENERATED)}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in names:
        path, render = GENERATED[name]
        path.write_text(render())
        logger.info("wrote %s", path.relative_to(ROOT))


if __name__ == "__main__":
    main()
