"""The image build's commands (server/image.py), without building: what docker and buildah are asked to do."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from server import image
from server.image import Build, Buildah, build_arg, declared_build_args, pinned, storage_driver
from server.paths import DOCKERFILE, REQUIREMENTS, ROOT


def test_docker_and_buildah_get_the_same_file_tag_arguments_and_context(tmp_path):
    build = Build("sd:test", build_args={"BASE_IMAGE": "docker.io/library/ubuntu:22.04"})
    shared = ["--file", str(DOCKERFILE), "--tag", "sd:test", "--build-arg", "BASE_IMAGE=docker.io/library/ubuntu:22.04"]
    assert build.docker() == ["docker", "build", *shared, str(ROOT)]
    command = build.buildah(Buildah(root=tmp_path), pull="never")
    assert command[:3] == ["buildah", "--storage-driver", "overlay"] and command[-len(shared) - 1 :] == [
        *shared,
        str(ROOT),
    ]
    # Chroot isolation needs no user namespaces; the docker format keeps the HEALTHCHECK.
    assert {"--isolation", "chroot", "--format", "docker", "--pull=never"} <= set(command)


def test_buildah_mounts_read_only_and_keeps_its_own_storage_where_asked(tmp_path):
    build = Build("sd:test", build_args={"TORCH_WHEEL_DIR": "/wheels"}, volumes={tmp_path: "/wheels"})
    command = build.buildah(Buildah(root=tmp_path / "storage"))
    assert command[command.index("--volume") + 1] == f"{tmp_path}:/wheels:ro"
    assert command[command.index("--root") + 1] == str(tmp_path / "storage")
    assert "--pull=true" in command


PROBE = image.overlay_mounts  # the real probe, for the test about it


@pytest.fixture(autouse=True)
def no_mounts(monkeypatch):
    """No overlay probe in these tests (it mounts): overlay mounts; as root."""
    monkeypatch.setattr(image, "overlay_mounts", lambda root: True)
    monkeypatch.setattr(image.os, "geteuid", lambda: 0)


def store(root: Path, driver: str, images: list) -> None:
    (root / f"{driver}-images").mkdir(parents=True)
    (root / f"{driver}-images" / "images.json").write_text(json.dumps(images))


@pytest.mark.parametrize(
    ("held", "mounts", "driver"),
    [
        ({}, True, "overlay"),
        ({}, False, "vfs"),
        ({"vfs": 1}, True, "vfs"),
        ({"overlay": 0, "vfs": 1}, True, "vfs"),  # buildah makes the folder, empty, for any command
        ({"overlay": 1, "vfs": 1}, False, "overlay"),
    ],
)
def test_a_storage_keeps_the_driver_holding_its_images_and_a_new_one_takes_overlay_where_it_mounts(
    tmp_path, monkeypatch, held, mounts, driver
):
    for name, count in held.items():
        store(tmp_path, name, [{"id": str(number)} for number in range(count)])
    monkeypatch.setattr(image, "overlay_mounts", lambda root: mounts)
    assert storage_driver(tmp_path) == driver
    assert Buildah(root=tmp_path).command("images")[:3] == ["buildah", "--storage-driver", driver]


def test_without_root_buildah_keeps_vfs(tmp_path, monkeypatch):
    store(tmp_path, "overlay", [{"id": "0"}])
    monkeypatch.setattr(image.os, "geteuid", lambda: 1000)
    assert storage_driver(tmp_path) == "vfs"


def test_the_overlay_probe_leaves_nothing_behind(tmp_path, monkeypatch):
    (tmp_path / "storage").mkdir()
    PROBE(tmp_path / "storage")  # mounted or not, as this machine allows
    assert not any((tmp_path / "storage").iterdir())
    monkeypatch.setattr(image.shutil, "which", lambda tool: None)
    assert not PROBE(tmp_path / "other") and not (tmp_path / "other").exists()


def test_docker_refuses_mounts_it_cannot_make(tmp_path):
    with pytest.raises(ValueError, match="buildah"):
        Build("sd:test", volumes={tmp_path: "/wheels"}).docker()


def test_a_build_argument_the_dockerfile_does_not_declare_is_refused():
    with pytest.raises(ValueError, match=r"\['TORCH_VERSION'\] are not declared"):
        Build("sd:test", build_args={"TORCH_VERSION": "2.0"}).arguments()


def test_declared_build_arguments_are_the_dockerfiles_arg_lines():
    assert declared_build_args() == {"BASE_IMAGE", "PYTHON_SOURCE", "TORCH_INDEX_URL", "TORCH_WHEEL_DIR", "PIP_CERT"}


def test_build_arguments_on_the_command_line_are_key_value():
    assert build_arg("PIP_CERT=") == ("PIP_CERT", "")
    assert build_arg("BASE_IMAGE=a=b") == ("BASE_IMAGE", "a=b")
    for text in ("BASE_IMAGE", "=x"):
        with pytest.raises(argparse.ArgumentTypeError, match="KEY=VALUE"):
            build_arg(text)


def test_the_torch_pin_is_requirements_txts():
    assert pinned("torch") in REQUIREMENTS.read_text().splitlines()
    with pytest.raises(LookupError):
        pinned("tensorflow")
