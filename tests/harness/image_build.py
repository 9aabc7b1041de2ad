"""The serving image's build beside the other tests: docker/Dockerfile's CPU variant as ``make image-test``
builds it (``server.image.local_cpu_build``, buildah, storage of its own), in a process of its own at the
lowest CPU priority, started with the session. The build is about 3 minutes of debootstrap, apt, pip and
buildah here, mostly in what the tests leave idle of the CPU, so the image test waits for what is left
of it instead of all of it. Its storage is removed the same way, once the image test is done.

    python -m tests.harness.image_build build --storage DIR --scratch DIR --tag TAG
    python -m tests.harness.image_build remove --storage DIR
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from server.image import Buildah, MissingTool, build_image, local_cpu_build, require
from server.paths import ROOT

logger = logging.getLogger("image")

LOWEST_NICE = 19
MISSING_TOOL = 3  # the build's exit code where buildah or debootstrap cannot be installed
AUTOGROUP = Path("/proc/self/autogroup")


def tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def lowest_priority() -> None:
    """Nice 19 for this process and what it starts, and for its session's autogroup where the kernel
    groups tasks by session (CONFIG_SCHED_AUTOGROUP): there a task's nice only ranks it within its
    session, and each session shares the CPU as its autogroup's nice says. The process is started in
    a session of its own, so this ranks it below the tests and their servers, not only within them."""
    os.nice(LOWEST_NICE - os.nice(0))
    if AUTOGROUP.exists():
        try:
            AUTOGROUP.write_text(str(LOWEST_NICE))
        except OSError as error:  # the build still runs, at its session's share of the CPU
            logger.warning("could not lower this session's CPU priority (%s): %s", AUTOGROUP, error)


def lower_new_sessions(interval: float = 0.25) -> None:
    """Keep every session under this process at the lowest priority, forever (a daemon thread's loop):
    buildah runs each RUN step (apt, pip) in a session of its own, whose autogroup starts at nice 0
    and would share the CPU equally with the tests' own sessions whatever its tasks' nice."""
    lowest = f"nice {LOWEST_NICE}"
    while True:
        for process in psutil.Process().children(recursive=True):
            autogroup = Path(f"/proc/{process.pid}/autogroup")
            with contextlib.suppress(OSError):  # gone, or the kernel has no autogroups
                if not autogroup.read_text().rstrip().endswith(lowest):
                    autogroup.write_text(str(LOWEST_NICE))
        time.sleep(interval)


def start(*arguments: str, output: Path | None = None) -> subprocess.Popen:
    """This module's command in a session of its own (``lowest_priority`` is its first step)."""
    with open(output or os.devnull, "w") as stream:
        return subprocess.Popen(
            [sys.executable, "-m", __name__, *arguments],
            cwd=ROOT,
            stdout=stream,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


class BuildFailed(RuntimeError):
    """The image's build exited with an error."""


class ImageBuild:
    """The build's process, started at once; ``wait`` for its outcome, ``remove`` the storage."""

    def __init__(self, tag: str, storage: Path, scratch: Path) -> None:
        self.tag, self.buildah, self.log = tag, Buildah(root=storage), scratch / "build.log"
        self.process = start(
            "build", "--storage", str(storage), "--scratch", str(scratch), "--tag", tag, output=self.log
        )
        self.removal: subprocess.Popen | None = None

    def wait(self, timeout: float) -> None:
        """Return once the image is built; raise ``MissingTool`` where buildah or debootstrap cannot be
        installed, ``BuildFailed`` with the build log's end where the build failed."""
        code = self.process.wait(timeout=timeout)
        if code == MISSING_TOOL:
            raise MissingTool(tail(self.log, 1))
        if code != 0:
            raise BuildFailed(f"building docker/Dockerfile failed (exit code {code}); the log ends:\n{tail(self.log)}")

    def remove(self) -> None:
        """Stop a build still running, remove the working containers, and start deleting the storage
        (``close`` waits for it)."""
        if self.removal is not None:
            return
        if self.process.poll() is None:
            for process in [*psutil.Process(self.process.pid).children(recursive=True), self.process]:
                with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                    process.kill()
            self.process.wait()
        subprocess.run(self.buildah.command("rm", "--all"), capture_output=True, check=False)
        self.removal = start("remove", "--storage", str(self.buildah.root))

    def close(self) -> None:
        self.remove()
        assert self.removal is not None
        self.removal.wait()


def build(tag: str, storage: Path, scratch: Path) -> None:
    """Build ``tag`` in ``storage``: the Debian base with debootstrap, then the CPU variant from local parts."""
    buildah = Buildah(root=storage)
    build = local_cpu_build(buildah, tag, scratch)
    try:
        build_image(build, "buildah", buildah, pull="never")
    finally:
        for host_path in build.volumes:  # the torch wheel (the CA bundle is the host's own)
            if host_path.is_relative_to(scratch):
                shutil.rmtree(host_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    building = commands.add_parser("build", help="build the image into its own storage")
    building.add_argument("--storage", type=Path, required=True, help="buildah's storage root, the build's own")
    building.add_argument("--scratch", type=Path, required=True, help="a directory for the base and the wheel")
    building.add_argument("--tag", required=True)
    removing = commands.add_parser("remove", help="delete the storage")
    removing.add_argument("--storage", type=Path, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    lowest_priority()
    threading.Thread(target=lower_new_sessions, daemon=True).start()
    if args.command == "remove":
        shutil.rmtree(args.storage, ignore_errors=True)
        return
    try:
        require("buildah", "debootstrap")
    except MissingTool as error:
        print(error, flush=True)
        sys.exit(MISSING_TOOL)
    build(args.tag, args.storage, args.scratch)


if __name__ == "__main__":
    main()
