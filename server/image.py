"""Build the serving image, ``docker/Dockerfile``: with docker where a Docker engine runs, else with buildah.

    python -m server.image                         # the GPU image on the CUDA base (make image)
    python -m server.image --build-arg KEY=VALUE   # any of the Dockerfile's build arguments
    python -m server.image --local-cpu             # the CPU variant from local parts only

``--local-cpu`` builds what the image test builds (``make image-test``), with no container registry: a
Debian 12 base made here with debootstrap (``FROM scratch`` and its root filesystem), Python from that
base's own packages, the torch wheel that pip downloads here for the pin (the CPU build where pip's
configuration offers one), and the CA bundle of this machine's pip, both mounted into the build. Only
buildah mounts directories into a build, so ``--local-cpu`` needs buildah.

buildah runs as root with chroot isolation (no daemon, no user namespaces) and the overlay storage driver
where an overlay filesystem mounts, else vfs (docs/deploy.md, "Building the image without a Docker engine").
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from server.paths import DOCKERFILE, REQUIREMENTS, ROOT

logger = logging.getLogger("image")

IMAGE = "stable-diffusion-torchserve:0.1"
CPU_IMAGE = f"{IMAGE}-cpu"
LOCAL_BASE = "localhost/debian-minbase:bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
# The suites Debian's own bookworm image lists: security fixes and stable updates with the release.
DEBIAN_SOURCES = (
    f"deb {DEBIAN_MIRROR} bookworm main\n"
    f"deb {DEBIAN_MIRROR} bookworm-updates main\n"
    "deb http://deb.debian.org/debian-security bookworm-security main\n"
)
# The image's Python (the Dockerfile's python3.11), for the torch wheel downloaded on the host.
IMAGE_PYTHON = "3.11"
# Where the build sees what --local-cpu mounts.
WHEELS_MOUNT = "/run/build/wheels"
PIP_CERT_MOUNT = "/run/build/pip-ca.crt"


class MissingTool(RuntimeError):
    """A tool the build needs is not installed and could not be installed."""


def require(*tools: str) -> None:
    """Install the missing ``tools`` (each is its Debian package's name) with apt-get where this runs as
    root on Debian or Ubuntu; raise ``MissingTool`` saying why where that is not possible or fails."""
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise MissingTool(f"{', '.join(missing)} not installed; install the Debian packages {' '.join(missing)}")
    logger.info("installing %s", " ".join(missing))
    environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update"], ["apt-get", "install", "-y", *missing]):
        result = subprocess.run(command, env=environment, capture_output=True, text=True)
        if result.returncode != 0:
            raise MissingTool(f"{' '.join(command)} failed: {result.stderr.strip()[-500:]}")
    still_missing = [tool for tool in missing if shutil.which(tool) is None]
    if still_missing:
        raise MissingTool(f"{', '.join(still_missing)} still missing after apt-get install")


def docker_engine() -> bool:
    """Whether a Docker engine answers here."""
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
    except subprocess.TimeoutExpired:
        return False


# buildah's storage drivers, in order of preference: overlay keeps layers as diffs (a working container
# copies nothing), vfs copies the whole image into each but needs no overlay filesystem.
STORAGE_DRIVERS = ("overlay", "vfs")
DEFAULT_STORAGE = Path("/var/lib/containers/storage")  # buildah's as root


@dataclass(frozen=True)
class Buildah:
    """buildah as root without a daemon, with chroot isolation; ``root`` keeps its images and
    containers apart from the machine's (the test's own storage)."""

    root: Path | None = None

    @cached_property
    def driver(self) -> str:
        root = self.root or DEFAULT_STORAGE
        driver = storage_driver(root)
        logger.info("buildah storage %s: the %s driver", root, driver)
        return driver

    def command(self, *args: str) -> list[str]:
        storage = ["--root", str(self.root), "--runroot", str(self.root / "run")] if self.root else []
        return ["buildah", "--storage-driver", self.driver, *storage, *args]

    def __call__(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess:
        """Run a buildah command to completion, raising on failure (stdout returned as text)."""
        return subprocess.run(self.command(*args), check=True, text=True, **kwargs)

    def has_image(self, name: str) -> bool:
        return subprocess.run(self.command("inspect", "--type", "image", name), capture_output=True).returncode == 0


def storage_driver(root: Path) -> str:
    """The driver of buildah's storage at ``root``: one that holds images there already (the preferred
    one where both do), else overlay where an overlay filesystem mounts there, else vfs (also when not
    root, as buildah's rootful storage is then out of reach)."""
    if os.geteuid() != 0:
        return "vfs"
    held = [driver for driver in STORAGE_DRIVERS if stored_images(root, driver)]
    if held:
        return held[0]
    return "overlay" if overlay_mounts(root) else "vfs"


def stored_images(root: Path, driver: str) -> int:
    """How many images buildah's storage at ``root`` holds with ``driver`` (its images.json; buildah
    makes the folder, empty, whenever a command runs with the driver)."""
    try:
        images = json.loads((root / f"{driver}-images" / "images.json").read_text())
    except (OSError, ValueError):
        return 0
    return len(images) if isinstance(images, list) else 0


def overlay_mounts(root: Path) -> bool:
    """Whether an overlay filesystem mounts in ``root`` (made where missing): with the kernel's overlay
    module, on a filesystem that can hold its upper layer (not an overlay itself)."""
    if shutil.which("mount") is None or shutil.which("umount") is None:
        return False
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    with tempfile.TemporaryDirectory(prefix="overlay-probe-", dir=root, ignore_cleanup_errors=True) as probe:
        lower, upper, work, merged = (Path(probe) / name for name in ("lower", "upper", "work", "merged"))
        for directory in (lower, upper, work, merged):
            directory.mkdir()
        options = f"lowerdir={lower},upperdir={upper},workdir={work}"
        mount = ["mount", "-t", "overlay", "overlay", "-o", options, str(merged)]
        mounted = subprocess.run(mount, capture_output=True).returncode == 0
        if mounted:
            subprocess.run(["umount", str(merged)], capture_output=True)
        return mounted


def declared_build_args() -> set[str]:
    """The build arguments docker/Dockerfile declares (its ARG lines)."""
    lines = DOCKERFILE.read_text().splitlines()
    return {line.split()[1].split("=")[0] for line in lines if line.startswith("ARG ")}


@dataclass
class Build:
    """One build of docker/Dockerfile: its tag, build arguments and (buildah only) mounted paths."""

    tag: str
    build_args: dict[str, str] = field(default_factory=dict)
    volumes: dict[Path, str] = field(default_factory=dict)  # host path -> path inside the build

    def arguments(self) -> list[str]:
        """The build's options and context, the same for docker build and buildah bud."""
        declared = declared_build_args()
        undeclared = set(self.build_args) - declared
        if undeclared:
            raise ValueError(
                f"build arguments {sorted(undeclared)} are not declared in docker/Dockerfile, "
                f"which declares {sorted(declared)}"
            )
        options = ["--file", str(DOCKERFILE), "--tag", self.tag]
        for name, value in self.build_args.items():
            options += ["--build-arg", f"{name}={value}"]
        return [*options, str(ROOT)]

    def docker(self) -> list[str]:
        if self.volumes:
            raise ValueError("docker build mounts nothing into a build: build with buildah (--engine buildah)")
        return ["docker", "build", *self.arguments()]

    def buildah(self, buildah: Buildah, pull: str = "true") -> list[str]:
        """``pull``: buildah's policy for the base, true (pull a newer one), false (only a missing one), never."""
        # The docker format keeps HEALTHCHECK (the OCI image format has no field for it).
        options = ["--isolation", "chroot", "--format", "docker", f"--pull={pull}"]
        for host, inside in self.volumes.items():
            options += ["--volume", f"{host}:{inside}:ro"]
        return buildah.command("bud", *options, *self.arguments())


def debian_base(buildah: Buildah, tag: str, scratch: Path) -> None:
    """Make a Debian 12 base image without a container registry: debootstrap's minimal system, FROM scratch."""
    rootfs, context = scratch / "rootfs", scratch / "base"
    try:
        logger.info("debootstrap --variant=minbase bookworm (about 30 s)")
        subprocess.run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), DEBIAN_MIRROR], check=True)
        (rootfs / "etc" / "apt" / "sources.list").write_text(DEBIAN_SOURCES)
        context.mkdir()
        subprocess.run(["tar", "-C", str(rootfs), "-cf", str(context / "rootfs.tar"), "."], check=True)
        (context / "Containerfile").write_text('FROM scratch\nADD rootfs.tar /\nCMD ["bash"]\n')
        buildah("bud", "--isolation", "chroot", "--pull=never", "--tag", tag, str(context))
    finally:
        for directory in (rootfs, context):
            shutil.rmtree(directory, ignore_errors=True)


def pinned(name: str) -> str:
    """``name==version`` as requirements.txt pins it."""
    for line in REQUIREMENTS.read_text().splitlines():
        if line.split("==")[0].strip().lower() == name:
            return line.strip()
    raise LookupError(f"requirements.txt does not pin {name}")


def torch_wheel(directory: Path) -> Path:
    """Download the pinned torch wheel for the image's Python on this machine's architecture, as this
    machine's pip resolves it (its index and links), into ``directory``."""
    version = IMAGE_PYTHON.replace(".", "")
    target = ["--python-version", IMAGE_PYTHON, "--implementation", "cp", "--abi", f"cp{version}"]
    target += ["--platform", f"manylinux_2_28_{platform.machine()}", "--only-binary=:all:"]
    torch = pinned("torch")
    download = ["download", "--quiet", "--no-deps", "--dest", str(directory), *target, torch]
    subprocess.run([sys.executable, "-m", "pip", *download], check=True)
    wheels = list(directory.glob("torch-*.whl"))
    if len(wheels) != 1:
        raise LookupError(f"pip download {torch} left {len(wheels)} torch wheels in {directory}")
    return wheels[0]


def pip_cert() -> Path | None:
    """The CA bundle this machine's pip verifies the index with, where it sets one (PIP_CERT, pip config)."""
    configured = os.environ.get("PIP_CERT")
    if not configured:
        query = [sys.executable, "-m", "pip", "config", "get", "global.cert"]
        configured = subprocess.run(query, capture_output=True, text=True).stdout.strip()
    return Path(configured) if configured and Path(configured).is_file() else None


def local_cpu_build(buildah: Buildah, tag: str, scratch: Path) -> Build:
    """The CPU variant from local parts: the Debian base (made once per storage), the torch wheel, pip's CA."""
    if not buildah.has_image(LOCAL_BASE):
        require("debootstrap")
        debian_base(buildah, LOCAL_BASE, scratch)
    wheels = scratch / "wheels"
    wheels.mkdir()
    logger.info("torch wheel: %s", torch_wheel(wheels).name)
    build = Build(
        tag,
        build_args={"BASE_IMAGE": LOCAL_BASE, "PYTHON_SOURCE": "base", "TORCH_WHEEL_DIR": WHEELS_MOUNT},
        volumes={wheels: WHEELS_MOUNT},
    )
    if cert := pip_cert():
        build.build_args["PIP_CERT"] = PIP_CERT_MOUNT
        build.volumes[cert] = PIP_CERT_MOUNT
    return build


def build_image(build: Build, engine: str, buildah: Buildah, pull: str = "true", **kwargs: Any) -> None:
    """Run the build with ``engine`` (docker or buildah); ``kwargs`` go to subprocess.run."""
    command = build.docker() if engine == "docker" else build.buildah(buildah, pull)
    logger.info("%s", " ".join(command))
    subprocess.run(command, check=True, **kwargs)


def build_arg(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` from the command line."""
    name, separator, value = text.partition("=")
    if not separator or not name:
        raise argparse.ArgumentTypeError(f"{text!r}: a build argument is KEY=VALUE")
    return name, value


def choose_engine(requested: str, local_cpu: bool) -> str:
    """docker or buildah: as asked, else docker where an engine answers (--local-cpu needs buildah)."""
    if requested == "auto":
        requested = "docker" if docker_engine() and not local_cpu else "buildah"
    if requested == "buildah":
        require("buildah")
    return requested


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", help=f"the image's name [{IMAGE}; {CPU_IMAGE} with --local-cpu]")
    parser.add_argument("--build-arg", action="append", type=build_arg, default=[], metavar="KEY=VALUE")
    parser.add_argument("--local-cpu", action="store_true", help="the CPU variant from local parts (buildah)")
    parser.add_argument("--engine", choices=["auto", "docker", "buildah"], default="auto")
    args = parser.parse_args()
    if args.local_cpu and args.engine == "docker":
        parser.error("--local-cpu mounts the torch wheel into the build, which only buildah does")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    tag = args.tag or (CPU_IMAGE if args.local_cpu else IMAGE)
    try:
        engine = choose_engine(args.engine, args.local_cpu)
        buildah = Buildah()
        with tempfile.TemporaryDirectory(prefix="image-") as scratch:
            build = local_cpu_build(buildah, tag, Path(scratch)) if args.local_cpu else Build(tag)
            build.build_args.update(args.build_arg)
            # --local-cpu: the local base is there; any other base is pulled only where missing.
            build_image(build, engine, buildah, pull="false" if args.local_cpu else "true")
    except (MissingTool, LookupError, ValueError) as error:
        sys.exit(f"image: {error}")
    except subprocess.CalledProcessError as error:
        sys.exit(f"image: {' '.join(map(str, error.cmd))} exited with {error.returncode}")
    logger.info("built %s with %s", tag, engine)


if __name__ == "__main__":
    main()
