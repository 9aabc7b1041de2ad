"""``python -m server.cli``: what ``make serve`` (through server/start.sh) and the container run.

- ``python -m server.cli [--config ...]``: TorchServe in the foreground on the addresses of
  config.properties, a ready-to-paste curl once a worker is ready, and on Ctrl-C or SIGTERM a
  drain (new requests get 503 with ``Retry-After``, the health check fails, the requests in flight
  finish within the stop grace period) and a clean stop (no process left behind);
- ``python -m server.cli stop``: stop the server running from a working directory and wait until
  it is gone (``make stop``, the Kubernetes ``preStop`` hook);
- ``python -m server.cli scale N``: set its workers to N; lowering the count waits until the
  workers to be removed have no request (``server/scaling.py``; ``make scale WORKERS=N``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

from server.paths import CONFIG_PROPERTIES, MODEL_STORE, RUNTIME
from server.process import (
    FRONTEND_START_SECONDS,
    TorchServe,
    archive_ready_timeout,
    archive_stop_grace,
)
from server.properties import KEY_FILE
from server.scaling import ScaleError, scale

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


def serve(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m server.cli", description="Serve the stable-diffusion archive with TorchServe in the foreground."
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
    parser.add_argument(
        "--stop-grace",
        type=float,
        help="on Ctrl-C or SIGTERM, seconds the requests in flight get to finish [the archive's request time limit "
        "(handler.request_timeout_s, by default 90%% of responseTimeout) + 5]",
    )
    args = parser.parse_args(argv)
    server = TorchServe(args.config, args.model_store, args.workdir, bind=args.bind)
    stop_requested = False

    def request_stop(signum, frame):
        nonlocal stop_requested
        if stop_requested and signum == signal.SIGTERM:
            return  # already draining (the container's SIGTERM after make stop or a preStop hook)
        stop_requested = True
        raise KeyboardInterrupt  # the first signal drains; a second Ctrl-C cuts the drain short

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)  # also when started with SIGINT ignored (a background job)
    pid_file = args.workdir / PID_FILE
    try:
        args.workdir.mkdir(parents=True, exist_ok=True)
        pid_file.write_text(str(os.getpid()))
        grace = args.stop_grace if args.stop_grace is not None else archive_stop_grace(server.model_store)
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
        if server.process is not None and server.process.poll() is None:  # also while a worker loads
            try:
                seconds, left = server.drain(grace)
                logger.info("drained in %.1f s (%d request(s) left unanswered)", seconds, left)
            except KeyboardInterrupt:
                logger.warning("second Ctrl-C: stopping without waiting for the requests in flight")
        logger.info("stopping TorchServe")
    finally:
        server.stop()
        pid_file.unlink(missing_ok=True)


def stop(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m server.cli stop",
        description="Stop the server running from WORKDIR (SIGTERM: it drains, then stops) and wait until it is gone.",
    )
    parser.add_argument("--workdir", type=Path, default=RUNTIME)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for it to be gone")
    args = parser.parse_args(argv)
    try:
        pid = int((args.workdir / PID_FILE).read_text())
        os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError) as error:
        raise SystemExit(f"no server to stop in {args.workdir} ({error})") from None
    logger.info("stop requested (pid %d); waiting while it drains", pid)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            logger.info("stopped")
            return
        time.sleep(0.5)
    raise SystemExit(f"the server (pid {pid}) is still running after {args.timeout:.0f} s")


def scale_workers(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m server.cli scale",
        description="Set the workers of the server running from WORKDIR; lowering the count waits until the workers "
        "to be removed have no request in flight, so that none is lost (a raw PUT ...?min_worker= under load can).",
    )
    parser.add_argument("workers", type=int)
    parser.add_argument("--workdir", type=Path, default=RUNTIME)
    parser.add_argument(
        "--park-timeout",
        type=float,
        help="seconds the workers to be removed get to finish what they hold [the model's responseTimeout: no batch "
        "runs longer]",
    )
    args = parser.parse_args(argv)
    server = TorchServe.attach(args.workdir)
    try:
        result = scale(server, args.workers, args.park_timeout or server.describe()["responseTimeout"])
    except ScaleError as error:
        raise SystemExit(f"not scaled: {error}") from None
    logger.info("workers: %d -> %d (parked %.1f s)", result.before, result.after, result.parked_s)


COMMANDS = {"stop": stop, "scale": scale_workers}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if argv and argv[0] in COMMANDS:
        COMMANDS[argv[0]](argv[1:])
    else:
        serve(argv)


if __name__ == "__main__":
    main()
