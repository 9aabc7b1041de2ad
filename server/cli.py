"""``python -m server.cli``: what ``make serve`` (through server/start.sh) and the container run.

TorchServe in the foreground on the addresses of config.properties, a ready-to-paste curl once a
worker is ready, and a clean stop (no Java process left behind) on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
from pathlib import Path
from urllib.parse import urlparse

from server.paths import CONFIG_PROPERTIES, MODEL_STORE, RUNTIME
from server.process import FRONTEND_START_SECONDS, TorchServe, archive_ready_timeout
from server.properties import KEY_FILE

logger = logging.getLogger("server")

PID_FILE = "server.pid"  # `make stop` sends SIGTERM to the process named here


def example_curl(server: TorchServe) -> str:
    """A ready-to-paste request that saves a PNG."""
    body = json.dumps({"prompt": "a red circle", "seed": 42})
    headers = [f"{name}: {value}" for name, value in server.auth().items()] + ["Content-Type: application/json"]
    return (
        f"curl -sS -o image.png -X POST {server.predictions_url} "
        + " ".join(f"-H {shlex.quote(header)}" for header in headers)
        + f" -d {shlex.quote(body)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Serve the stable-diffusion archive with TorchServe in the foreground."
    )
    parser.add_argument("--config", type=Path, default=CONFIG_PROPERTIES)
    parser.add_argument("--model-store", type=Path, default=MODEL_STORE)
    parser.add_argument("--workdir", type=Path, default=RUNTIME, help="key_file.json and logs/ go here")
    parser.add_argument(
        "--timeout",
        type=float,
        help=f"seconds to wait for a ready worker [the archive's startupTimeout + {FRONTEND_START_SECONDS}]",
    )
    parser.add_argument("--bind", help="listen on this host instead of the config's (0.0.0.0 in a container)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")

    server = TorchServe(args.config, args.model_store, args.workdir, bind=args.bind)
    stop_requested = False

    def request_stop(signum, frame):
        nonlocal stop_requested
        stop_requested = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)  # also when started with SIGINT ignored (a background job)
    pid_file = args.workdir / PID_FILE
    try:
        args.workdir.mkdir(parents=True, exist_ok=True)
        pid_file.write_text(str(os.getpid()))
        server.start()
        seen = []

        def progress(status: list[str]) -> None:
            # The describe API reports a worker that is still loading as UNLOADING.
            shown = ", ".join("ready" if state == "READY" else "loading" for state in status) or "starting"
            if shown not in seen:
                seen.append(shown)
                logger.info("workers: %s", shown)

        timeout = args.timeout or archive_ready_timeout(server.model_store, server.model_name)
        logger.info("waiting up to %.0f s for a ready worker", timeout)
        server.wait_ready(timeout, progress)
        parsed = urlparse(server.addresses.inference)
        keys = f"Keys: {server.workdir / KEY_FILE}" if server.token_authorization else "Token authorization is off."
        print(
            f"\nstable-diffusion is ready on {parsed.netloc} (management {server.addresses.management}, "
            f"metrics {server.addresses.metrics}/metrics).\n{keys}\n"
            f"Try:\n\n  {example_curl(server)}\n\nCtrl-C stops the server.\n",
            flush=True,
        )
        server.process.wait()
        if not stop_requested:
            raise SystemExit(f"TorchServe exited with status {server.process.returncode}; see {server.console_log}")
    except KeyboardInterrupt:
        logger.info("stopping TorchServe")
    finally:
        server.stop()
        pid_file.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
