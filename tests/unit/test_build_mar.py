"""Packaging: safetensors only, the archive layout TorchServe loads, rebuilds only on change."""

import shutil
import zipfile
from pathlib import Path

import pytest

from scripts.build_mar import build
from scripts.server import find_archive

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "models" / "tiny-sd"
CONFIG = ROOT / "model-config.yaml"


@pytest.fixture
def model_copy(tmp_path) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(MODEL_DIR, copy)
    return copy


def test_archive_holds_handler_package_config_and_safetensors_only(tmp_path, model_copy):
    (model_copy / "unet" / "diffusion_pytorch_model.bin").write_bytes(b"pickle")
    archive = build(model_copy, CONFIG, tmp_path / "store")
    assert archive == tmp_path / "store" / "stable-diffusion.mar" and find_archive(tmp_path / "store") == archive.name
    names = set(zipfile.ZipFile(archive).namelist())
    assert {"sd_handler.py", "handler/sd_handler.py", "handler/request.py", "model-config.yaml", "MAR-INF/MANIFEST.json"} <= names
    assert "model/unet/diffusion_pytorch_model.safetensors" in names and "model/model_index.json" in names
    assert not any(name.endswith(".bin") for name in names)


def test_unchanged_inputs_skip_the_build_and_a_change_rebuilds(tmp_path, model_copy):
    archive = build(model_copy, CONFIG, tmp_path / "store")
    built_at = archive.stat().st_mtime_ns
    assert build(model_copy, CONFIG, tmp_path / "store").stat().st_mtime_ns == built_at
    (model_copy / "scheduler" / "scheduler_config.json").write_text((model_copy / "scheduler" / "scheduler_config.json").read_text() + " ")
    assert build(model_copy, CONFIG, tmp_path / "store").stat().st_mtime_ns != built_at


def test_no_archive_format_is_a_directory_and_replaces_the_mar(tmp_path, model_copy):
    build(model_copy, CONFIG, tmp_path / "store")
    directory = build(model_copy, CONFIG, tmp_path / "store", archive_format="no-archive")
    assert (directory / "MAR-INF" / "MANIFEST.json").is_file() and (directory / "model" / "model_index.json").is_file()
    assert not (tmp_path / "store" / "stable-diffusion.mar").exists()
    assert find_archive(tmp_path / "store") == "stable-diffusion"


def test_a_model_without_safetensors_is_refused(tmp_path, model_copy):
    for weights in model_copy.rglob("*.safetensors"):
        weights.rename(weights.with_suffix(".bin"))
    with pytest.raises(SystemExit, match="no .safetensors weights"):
        build(model_copy, CONFIG, tmp_path / "store")
