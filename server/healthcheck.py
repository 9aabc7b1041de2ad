"""Exit 0 when the local TorchServe answers ``/ping`` with Healthy and is not stopping, 1 otherwise.

For the container's HEALTHCHECK and Kubernetes exec probes: it reads the address and the inference
key from the server's working directory (the effective config.properties and key_file.json that
``server.process`` leaves there), so no key appears in a probe definition or a process list. From
the moment a stop begins (its drain), it fails, so that load balancers send no more requests.

    python -m server.healthcheck --workdir /var/lib/torchserve
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import requests

from server.control import ControlDir
from server.properties import EFFECTIVE_CONFIG, KEY_FILE, reach


def ping(workdir: Path, timeout: float) -> tuple[bool, str]:
    """Whether the server in ``workdir`` is healthy, and what it said."""
    config = workdir / EFFECTIVE_CONFIG
    if not config.is_file():
        return False, f"{config} is missing: the server has not started"
    if ControlDir.of(workdir).drain() is not None:
        return False, "the server is stopping (draining the requests in flight)"
    try:
        addresses, headers = reach(workdir)
    except (OSError, ValueError, KeyError) as error:
        return False, f"cannot reach the server from {workdir} ({EFFECTIVE_CONFIG}, {KEY_FILE}): {error}"
    url = f"{addresses.inference}/ping"
    try:
        response = requests.get(url, headers=headers, timeout=timeout)
    except requests.RequestException as error:
        return False, f"{url}: {error}"
    healthy = response.status_code == 200 and response.json().get("status") == "Healthy"
    return healthy, f"{url}: {response.status_code} {response.text.strip()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("runtime"), help="the server's working directory")
    parser.add_argument("--timeout", type=float, default=5.0)
    args = parser.parse_args()
    healthy, message = ping(args.workdir, args.timeout)
    print(message)
    sys.exit(0 if healthy else 1)


if __name__ == "__main__":
    main()
