"""The serving image's build beside the other tests: docker/Dockerfile's CPU variant as ``make image-test``
builds it (``server.image.local_cpu_build``, buildah, storage of its own), in a process of its own at the
lowest CPU priority, started with the session. The build is about 3 minutes of debootstrap, apt, pip and
buildah here, mostly in what the tests leave idle of the CPU, so the image test waits for what is left
of it instead of all of it. Its storage is removed the same way, once the image test is done.

    python -m tests.harness.image_build --storage DIR --scratch DIR --tag TAG   # what the process runs
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import psutil

from server.image import Buildah, MissingTool, build_image, local_cpu_build, require
from server.paths import ROOT

logger = logging.getLogger("image")

LOWEST_PRIORITY = ["nice", "-n", "19"]
MISSING_TOOL = 3  # the process's exit code where buildah or debootstrap cannot be installed


def tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class BuildFailed(RuntimeError):
    """The image's build exited with an error."""


class ImageBuild:
    """The build's process, started at once; ``wait`` for its outcome, ``remove`` the storage."""

    def __init__(self, tag: str, storage: Path, scratch: Path) -> None:
        self.tag, self.buildah, self.log = tag, Buildah(root=storage), scratch / "build.log"
        arguments = ["--storage", str(storage), "--scratch", str(scratch), "--tag", tag]
        with self.log.open("w") as output:
            self.process = subprocess.Popen(
                [*LOWEST_PRIORITY, sys.executable, "-m", __name__, *arguments],
                cwd=ROOT,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
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
        at the lowest priority (``close`` waits for it)."""
        if self.removal is not None:
            return
        if self.process.poll() is None:
            for process in [*psutil.Process(self.process.pid).children(recursive=True), self.process]:
                with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                    process.kill()
            self.process.wait()
        subprocess.run(self.buildah.command("rm", "--all"), capture_output=True, check=False)
        self.removal = subprocess.Popen([*LOWEST_PRIORITY, "rm", "-rf", str(self.buildah.root)])

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
    parser.add_argument("--storage", type=Path, required=True, help="buildah's storage root, the build's own")
    parser.add_argument("--scratch", type=Path, required=True, help="a directory for the base and the wheel")
    parser.add_argument("--tag", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        require("buildah", "debootstrap")
    except MissingTool as error:
        print(error, flush=True)
        sys.exit(MISSING_TOOL)
    build(args.tag, args.storage, args.scratch)


if __name__ == "__main__":
    main()
