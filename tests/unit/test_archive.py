"""Packaging: safetensors only, the archive layout TorchServe loads, rebuilds only on change."""

import logging
import shutil
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from server.archive import (
    BATCH_DELAY_MS,
    archive_model_config,
    build,
    console_script,
    default_workers,
    serving_defaults,
    write_model_config,
)
from server.paths import MODEL_CONFIG, RANDOM_MODEL_DIR
from server.process import FRONTEND_START_SECONDS, archive_ready_timeout, find_archive, ready_timeout
from tests.harness.serving import SHIPPED_CONFIG


@pytest.fixture
def model_copy(tmp_path) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(RANDOM_MODEL_DIR, copy)
    return copy


def test_archive_holds_handler_package_config_and_safetensors_only(tmp_path, model_copy):
    (model_copy / "unet" / "diffusion_pytorch_model.bin").write_bytes(b"pickle")
    archive = build(model_copy, MODEL_CONFIG, tmp_path / "store")
    assert archive == tmp_path / "store" / "stable-diffusion.mar" and find_archive(tmp_path / "store") == archive.name
    names = set(zipfile.ZipFile(archive).namelist())
    assert {
        "sd_handler.py",
        "handler/sd_handler.py",
        "handler/api/request.py",
        "model-config.yaml",
        "MAR-INF/MANIFEST.json",
    } <= names
    assert "model/unet/diffusion_pytorch_model.safetensors" in names and "model/model_index.json" in names
    assert not any(name.endswith(".bin") for name in names)


def test_unchanged_inputs_skip_the_build_and_a_change_rebuilds(tmp_path, model_copy):
    archive = build(model_copy, MODEL_CONFIG, tmp_path / "store")
    built_at = archive.stat().st_mtime_ns
    assert build(model_copy, MODEL_CONFIG, tmp_path / "store").stat().st_mtime_ns == built_at
    (model_copy / "scheduler" / "scheduler_config.json").write_text(
        (model_copy / "scheduler" / "scheduler_config.json").read_text() + " "
    )
    assert build(model_copy, MODEL_CONFIG, tmp_path / "store").stat().st_mtime_ns != built_at


def test_the_archiver_stages_in_a_directory_of_the_builds_own(tmp_path, model_copy, monkeypatch):
    """torch-model-archiver copies the files into ``$TMPDIR/<model name>`` after removing it: the build
    gives it a temporary directory of its own, so another build's staging there is left alone."""
    monkeypatch.setenv("TMPDIR", str(tmp_path / "shared-tmp"))
    another_build = tmp_path / "shared-tmp" / "stable-diffusion"
    another_build.mkdir(parents=True)
    (another_build / "staged").write_text("another build's file")
    archive = build(model_copy, MODEL_CONFIG, tmp_path / "store")
    assert (another_build / "staged").read_text() == "another build's file"
    assert "model/model_index.json" in zipfile.ZipFile(archive).namelist()


def test_no_archive_format_is_a_directory_and_replaces_the_mar(tmp_path, model_copy):
    build(model_copy, MODEL_CONFIG, tmp_path / "store")
    directory = build(model_copy, MODEL_CONFIG, tmp_path / "store", archive_format="no-archive")
    assert (directory / "MAR-INF" / "MANIFEST.json").is_file() and (directory / "model" / "model_index.json").is_file()
    assert not (tmp_path / "store" / "stable-diffusion.mar").exists()
    assert find_archive(tmp_path / "store") == "stable-diffusion"


def test_a_single_file_checkpoint_is_packaged_with_the_yaml_beside_it_and_the_handlers_data(tmp_path):
    checkpoint, beside = tmp_path / "models" / "x.safetensors", tmp_path / "models" / "x.yaml"
    checkpoint.parent.mkdir()
    checkpoint.write_bytes(b"weights")
    beside.write_text("model: {params: {parameterization: v}}\n")
    (tmp_path / "models" / "other.safetensors").write_bytes(b"not packaged")
    names = set(zipfile.ZipFile(build(checkpoint, MODEL_CONFIG, tmp_path / "store")).namelist())
    assert {"model/x.safetensors", "model/x.yaml"} <= names and "model/other.safetensors" not in names
    # The shipped architectures' configs and tokenizer vocabularies travel with the handler.
    assert {
        "handler/checkpoints/configs/sd1/unet/config.json",
        "handler/checkpoints/assets/t5_tokenizer.json.gz",
    } <= names
    (tmp_path / "models" / "x.ckpt").write_bytes(b"pickle")
    with pytest.raises(SystemExit, match=r"x.ckpt: only .safetensors checkpoints are served"):
        build(tmp_path / "models" / "x.ckpt", MODEL_CONFIG, tmp_path / "store")


def test_a_model_without_safetensors_is_refused(tmp_path, model_copy):
    for weights in model_copy.rglob("*.safetensors"):
        weights.rename(weights.with_suffix(".bin"))
    with pytest.raises(SystemExit, match="no .safetensors weights"):
        build(model_copy, MODEL_CONFIG, tmp_path / "store")


@pytest.mark.parametrize(
    ("config", "gpus", "workers"),
    [
        ({}, 0, 1),  # a CPU host: one worker
        ({}, 1, 1),
        ({}, 4, 4),  # one worker per visible GPU
        ({"deviceIds": [0, 2]}, 4, 2),  # one per GPU the config names
        ({"deviceType": "cpu"}, 4, 1),  # on the CPU of a GPU host
        ({"handler": {"device": "cpu"}}, 4, 1),
        ({"continuousBatching": True}, 4, 1),  # TorchServe 0.12: continuous batching, one worker
        ({"minWorkers": 2, "maxWorkers": 2}, 4, 2),  # set by the user: kept
        ({"maxWorkers": 3}, 0, 3),  # one of them set: the other follows (TorchServe 0.12 ignores a lone one)
        ({"minWorkers": 2}, 4, 2),
    ],
)
def test_workers_default_to_one_per_gpu_used(config, gpus, workers):
    filled, reason = default_workers(config, gpus)
    assert reason and (filled["minWorkers"], filled["maxWorkers"]) == (workers, workers)


@pytest.mark.parametrize(
    ("config", "gpus", "continuous"),
    [
        ({}, 0, True),  # a CPU host: one worker, so the step engine's continuous batching
        ({}, 1, True),  # one visible GPU (a one-GPU pod, the Compose stack)
        ({}, 4, False),  # one worker per GPU: TorchServe 0.12 stalls continuous batching with several
        ({"deviceIds": [3]}, 4, True),
        ({"handler": {"device": "cpu"}}, 4, True),
        ({"minWorkers": 2, "maxWorkers": 2}, 1, False),  # several workers set by the user
        ({"maxWorkers": 3}, 0, False),
        ({"minWorkers": 1, "maxWorkers": 1}, 4, True),
        ({"continuousBatching": False}, 0, False),  # the user's choice always wins
        ({"continuousBatching": True}, 4, True),
        ({"continuousBatching": True, "minWorkers": 2, "maxWorkers": 2}, 4, True),  # kept; the worker refuses it
    ],
)
def test_the_batching_mode_follows_the_worker_count_unless_the_config_sets_it(config, gpus, continuous):
    filled, chosen = serving_defaults(config, gpus)
    assert filled["continuousBatching"] is continuous
    assert ("batching: continuous" if continuous else "batching: dynamic") in chosen
    if "continuousBatching" in config:
        assert "batching: " + ("continuous" if continuous else "dynamic") + " (set in the model config)" in chosen


@pytest.mark.parametrize(
    ("config", "delay"),
    [
        ({"continuousBatching": True}, BATCH_DELAY_MS["continuous"]),
        ({"continuousBatching": False}, BATCH_DELAY_MS["dynamic"]),
        ({"minWorkers": 2, "maxWorkers": 2}, BATCH_DELAY_MS["dynamic"]),  # several workers: dynamic batching
        ({"continuousBatching": True, "maxBatchDelay": 20}, 20),  # the user's choice always wins
        ({"continuousBatching": False, "maxBatchDelay": 0}, 0),
    ],
)
def test_the_batch_delay_follows_the_batching_mode_unless_the_config_sets_it(config, delay):
    filled, chosen = serving_defaults(config, gpus=0)
    assert filled["maxBatchDelay"] == delay and f"maxBatchDelay: {delay} ms" in chosen
    assert BATCH_DELAY_MS["continuous"] < BATCH_DELAY_MS["dynamic"]  # an idle continuous worker need not wait


def test_the_archive_config_gets_workers_and_batching_and_the_shipped_one_sets_neither(tmp_path, model_copy, caplog):
    shipped = SHIPPED_CONFIG
    assert not {"minWorkers", "maxWorkers", "continuousBatching", "maxBatchDelay"} & set(shipped)
    archive = build(model_copy, MODEL_CONFIG, tmp_path / "store", gpus=2)
    packaged = yaml.safe_load(zipfile.ZipFile(archive).read("model-config.yaml"))
    assert (packaged["minWorkers"], packaged["maxWorkers"], packaged["continuousBatching"]) == (2, 2, False)
    assert packaged["maxBatchDelay"] == BATCH_DELAY_MS["dynamic"]
    assert packaged["handler"] == shipped["handler"]
    with caplog.at_level(logging.INFO, logger="archive"):
        build(model_copy, MODEL_CONFIG, tmp_path / "store", gpus=1)
    packaged = yaml.safe_load(zipfile.ZipFile(archive).read("model-config.yaml"))
    assert (packaged["minWorkers"], packaged["continuousBatching"]) == (1, True), "a different GPU count rebuilds"
    assert packaged["maxBatchDelay"] == BATCH_DELAY_MS["continuous"]
    assert "workers: 1 (one per visible GPU, 1 visible); batching: continuous (one worker" in caplog.text


def test_an_absolute_model_path_packages_no_weights(tmp_path, model_copy):
    config = write_model_config(tmp_path, handler={"model_path": str(model_copy)})
    names = zipfile.ZipFile(build(model_copy, config, tmp_path / "store")).namelist()
    assert "handler/sd_handler.py" in names and not any(name.startswith("model/") for name in names)


@pytest.mark.parametrize("archive_format", ["default", "no-archive"])
def test_serve_waits_as_long_as_the_archives_startup_timeout_allows(tmp_path, model_copy, archive_format):
    config = write_model_config(tmp_path, startupTimeout=1234)
    store = build(model_copy, config, tmp_path / "store", archive_format=archive_format).parent
    packaged = archive_model_config(store, find_archive(store))
    assert packaged["startupTimeout"] == 1234 and ready_timeout(packaged) == 1234 + FRONTEND_START_SECONDS
    assert archive_ready_timeout(store) == 1234 + FRONTEND_START_SECONDS
    assert ready_timeout({}) == 120 + FRONTEND_START_SECONDS, "TorchServe's own default when the config sets none"


def test_commands_are_found_beside_python_then_on_path(tmp_path, monkeypatch):
    """In a venv the commands sit beside its Python; where wheels were installed with --target
    (a GPU host without an index) they are on PATH."""
    assert console_script("torchserve") == str(Path(sys.executable).parent / "torchserve")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python3"))
    on_path = tmp_path / "bin" / "torchserve"
    on_path.parent.mkdir()
    on_path.write_text("#!/bin/sh\n")
    on_path.chmod(0o755)
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert console_script("torchserve") == str(on_path)
    with pytest.raises(FileNotFoundError, match="torch-model-archiver is neither beside"):
        console_script("torch-model-archiver")
