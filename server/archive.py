"""Package the handler, a diffusers pipeline (or a single-file checkpoint) and model-config.yaml into
a TorchServe archive.

Only safetensors weights are packaged; pickle weights (.bin, .ckpt, .pt, .pth, .pkl) are left out.
Small models become ``NAME.mar``; large ones (or ``--archive-format no-archive``) become a
directory ``NAME/`` in the model store, which TorchServe loads without unzipping gigabytes. With
``handler.model_path`` absolute, the worker loads the model from there and no weights are packaged.

The packaged model-config.yaml is the given one with the worker count filled in where it sets
neither ``minWorkers`` nor ``maxWorkers`` (one worker per GPU visible here, or ``--gpus``:
TorchServe gives workers GPUs round-robin; one on a CPU host or device or with continuous
batching), then the batching mode where it does not set ``continuousBatching``: continuous
batching with one worker, dynamic batching with several; then ``maxBatchDelay`` where it does not
set it, the one measured best for that mode (``BATCH_DELAY_MS``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import yaml

from server.paths import HANDLER_PACKAGE, MODEL_CONFIG, MODEL_STORE

logger = logging.getLogger("archive")

MODEL_NAME = "stable-diffusion"
PICKLE_SUFFIXES = {".bin", ".ckpt", ".pt", ".pth", ".pkl", ".pickle"}
NO_ARCHIVE_ABOVE_BYTES = 1 << 30
# maxBatchDelay (ms) per batching mode, where model-config.yaml leaves it out (docs/benchmarks.md,
# "Serving overhead"). Continuous batching: an idle worker waits this long for batchmates before its
# first step, although a later request joins at the next step anyway; so the least wait. Not 0:
# TorchServe 0.12 counts the delay down while it takes queued requests, in flight or not, and at 0
# stops after one, so that one request joined per call. Dynamic batching: a batch is closed after
# this long, and a request arriving later waits for the whole batch.
BATCH_DELAY_MS = {"continuous": 1, "dynamic": 50}
MANIFEST = "MAR-INF/MANIFEST.json"


def merged_model_config(handler: dict | None = None, **frontend) -> dict:
    """The shipped model-config.yaml with frontend keys (``continuousBatching``, ``batchSize``, ...)
    and ``handler:`` settings replaced (sections such as ``limits`` key by key, one level deep)."""
    config = yaml.safe_load(MODEL_CONFIG.read_text())
    config.update(frontend)
    shipped = config["handler"]
    for key, setting in (handler or {}).items():
        shipped[key] = (
            {**shipped[key], **setting} if isinstance(setting, dict) and isinstance(shipped.get(key), dict) else setting
        )
    return config


def write_model_config(directory: Path, handler: dict | None = None, **frontend) -> Path:
    """``merged_model_config(handler, **frontend)`` written into ``directory`` for an archive built from it."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "model-config.yaml"
    path.write_text(yaml.safe_dump(merged_model_config(handler, **frontend)))
    return path


def default_workers(config: dict, gpus: int) -> tuple[dict, str]:
    """``config`` with ``minWorkers``/``maxWorkers`` set where it sets neither, and why: one per GPU
    the workers will use (the visible ones, or ``deviceIds``); one on a CPU host or device, and one
    with continuous batching (TorchServe 0.12 serves it with one worker only). Where it sets one of
    them, the other is set to the same: TorchServe 0.12 ignores a lone one (it wants both, with
    ``maxWorkers`` at least ``minWorkers``) and would start its default count instead."""
    if "minWorkers" in config and "maxWorkers" in config:
        return config, "set in the model config"
    if "minWorkers" in config or "maxWorkers" in config:
        given = config.get("minWorkers", config.get("maxWorkers"))
        return {**config, "minWorkers": given, "maxWorkers": given}, "set in the model config, for both bounds"
    on_cpu = gpus == 0 or config.get("deviceType") == "cpu" or (config.get("handler") or {}).get("device") == "cpu"
    if config.get("continuousBatching"):
        workers, reason = 1, "continuous batching serves one worker"
    elif on_cpu:
        workers, reason = 1, "no GPU used"
    elif config.get("deviceIds"):
        workers, reason = len(config["deviceIds"]), "one per GPU in deviceIds"
    else:
        workers, reason = gpus, f"one per visible GPU, {gpus} visible"
    return {**config, "minWorkers": workers, "maxWorkers": workers}, reason


def default_batching(config: dict) -> tuple[dict, str]:
    """``config`` with ``continuousBatching`` set where it does not set it, and why: the step
    engine's continuous batching where the model runs one worker, dynamic batching where it runs
    several (TorchServe 0.12 stalls continuous batching with more than one worker per model)."""
    workers = max(int(config.get("minWorkers", 1)), int(config.get("maxWorkers", 1)))
    if "continuousBatching" in config:
        if config["continuousBatching"] and workers > 1:
            logger.warning(
                "continuousBatching: true with %d workers: every worker will refuse to load (TorchServe 0.12 serves "
                "continuous batching with one worker per model); set one worker or continuousBatching: false",
                workers,
            )
        return config, "set in the model config"
    if workers == 1:
        return {**config, "continuousBatching": True}, "one worker: requests join and leave between steps"
    return {**config, "continuousBatching": False}, (
        f"{workers} workers: TorchServe 0.12 serves continuous batching with one worker per model"
    )


def _batching_mode(config: dict) -> str:
    """``continuous`` or ``dynamic``, as ``config`` (its batching mode set) says."""
    return "continuous" if config["continuousBatching"] else "dynamic"


def default_batch_delay(config: dict) -> tuple[dict, str]:
    """``config`` (its batching mode set) with ``maxBatchDelay`` set where it does not set it, and why."""
    if "maxBatchDelay" in config:
        return config, "set in the model config"
    mode = _batching_mode(config)
    return {**config, "maxBatchDelay": BATCH_DELAY_MS[mode]}, f"{mode} batching's"


def visible_gpus() -> int:
    """CUDA devices this process sees (``CUDA_VISIBLE_DEVICES`` applies)."""
    import torch  # here: it takes seconds to import, and the health check imports this module's importers

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def serving_defaults(config: dict, gpus: int) -> tuple[dict, str]:
    """``config`` as it serves on a host with ``gpus`` GPUs: the worker count, then the batching
    mode, then the batch delay, filled in where it leaves them out; and a sentence saying what was
    chosen and why."""
    with_workers, workers_reason = default_workers(config, gpus)
    with_mode, batching_reason = default_batching(with_workers)
    filled, delay_reason = default_batch_delay(with_mode)
    workers = filled.get("minWorkers", filled.get("maxWorkers", "TorchServe's default"))
    return filled, (
        f"workers: {workers} ({workers_reason}); batching: {_batching_mode(filled)} ({batching_reason}); "
        f"maxBatchDelay: {filled['maxBatchDelay']} ms ({delay_reason}); "
        "set minWorkers/maxWorkers, continuousBatching and maxBatchDelay in model-config.yaml to choose"
    )


def packaged_config(config: Path, gpus: int) -> tuple[str, dict]:
    """The model-config.yaml that goes into the archive, its text and its settings (the serving
    defaults filled in, logged)."""
    text = config.read_text()
    loaded = yaml.safe_load(text) or {}
    filled, chosen = serving_defaults(loaded, gpus)
    logger.info("%s", chosen)
    if filled == loaded:
        return text, loaded
    return yaml.safe_dump(filled, sort_keys=False), filled


def loads_weights_from_archive(config: dict) -> bool:
    """False when ``handler.model_path`` is absolute: the worker loads the model from there."""
    return not Path((config.get("handler") or {}).get("model_path", "model")).is_absolute()


def _model_root(model: Path) -> Path:
    """The directory the packaged model files are taken relative to: a diffusers directory, or a
    single-file checkpoint's own directory."""
    return model.parent if model.is_file() else model


def _model_files(model_dir: Path) -> list[Path]:
    """A diffusers directory's files (pickle weights left out), or a single-file checkpoint and an
    A1111 ``.yaml`` beside it."""
    if model_dir.is_file():
        if model_dir.suffix.lower() != ".safetensors":
            raise SystemExit(f"{model_dir.name}: only .safetensors checkpoints are served (not {model_dir.suffix})")
        beside = model_dir.with_suffix(".yaml")
        return [model_dir, beside] if beside.is_file() else [model_dir]
    files = sorted(path for path in model_dir.rglob("*") if path.is_file() and ".cache" not in path.parts)
    if not any(path.suffix == ".safetensors" for path in files):
        raise SystemExit(f"{model_dir} has no .safetensors weights; only safetensors models are served")
    skipped = [path for path in files if path.suffix.lower() in PICKLE_SUFFIXES]
    if skipped:
        logger.warning("leaving out %d pickle weight files (safetensors only): %s", len(skipped), skipped[:3])
    return [path for path in files if path.suffix.lower() not in PICKLE_SUFFIXES]


def _handler_files() -> list[Path]:
    """The handler package: its modules, its subpackages' included, and the data they read (the
    single-file architectures' configs, CLIP's vocabulary)."""
    return sorted(path for path in HANDLER_PACKAGE.rglob("*") if path.is_file() and "__pycache__" not in path.parts)


def _fingerprint(model_files: list[Path], model_dir: Path, config_text: str, archive_format: str) -> str:
    """Changes when the handler code, the config, the format or any model file changes."""
    digest = hashlib.sha256(archive_format.encode() + config_text.encode())
    for path in _handler_files():
        digest.update(str(path.relative_to(HANDLER_PACKAGE)).encode() + path.read_bytes())
    for path in model_files:
        stat = path.stat()
        digest.update(f"{path.relative_to(_model_root(model_dir))}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def _link_or_copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _stage(model_dir: Path, model_files: list[Path], stage: Path) -> None:
    """The archive root: the ``handler`` package and the pipeline under ``model/``."""
    for path in _handler_files():
        _link_or_copy(path, stage / "handler" / path.relative_to(HANDLER_PACKAGE))
    for path in model_files:
        _link_or_copy(path, stage / "model" / path.relative_to(_model_root(model_dir)))


def _archive_file(archive: Path, name: str) -> str:
    if archive.is_dir():
        return (archive / name).read_text()
    with zipfile.ZipFile(archive) as mar:
        return mar.read(name).decode()


def archive_model_config(model_store: Path, archive: str) -> dict:
    """The model-config.yaml packaged in ``archive`` (a .mar or a no-archive directory); {} if none."""
    path = model_store / archive
    config_file = json.loads(_archive_file(path, MANIFEST))["model"].get("configFile")
    return (yaml.safe_load(_archive_file(path, config_file)) or {}) if config_file else {}


def console_script(name: str) -> str:
    """An installed command: beside this Python (a virtual environment's ``bin/``), else on PATH
    (where ``pip install --target`` put it, as on the GPU machine)."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} is neither beside {sys.executable} nor on PATH: install requirements.txt")
    return found


def archive_path(export_path: Path, archive_format: str, model_name: str = MODEL_NAME) -> Path:
    return export_path / (model_name if archive_format == "no-archive" else f"{model_name}.mar")


def build(
    model_dir: Path,
    config: Path,
    export_path: Path,
    archive_format: str = "auto",
    model_name: str = MODEL_NAME,
    gpus: int | None = None,
) -> Path:
    """Build the archive unless an identical one exists; return its path. ``gpus``: the GPUs the
    worker count is chosen for (default: those visible here)."""
    config_text, settings = packaged_config(config, visible_gpus() if gpus is None else gpus)
    model_files = _model_files(model_dir) if loads_weights_from_archive(settings) else []
    if archive_format == "auto":
        size = sum(path.stat().st_size for path in model_files)
        archive_format = "no-archive" if size > NO_ARCHIVE_ABOVE_BYTES else "default"
    target = archive_path(export_path, archive_format, model_name)
    stamp = export_path / f".{model_name}.fingerprint"
    fingerprint = _fingerprint(model_files, model_dir, config_text, archive_format)
    if target.exists() and stamp.is_file() and stamp.read_text() == fingerprint:
        logger.info("%s is up to date", target)
        return target
    export_path.mkdir(parents=True, exist_ok=True)
    for stale in (
        archive_path(export_path, "default", model_name),
        archive_path(export_path, "no-archive", model_name),
    ):
        shutil.rmtree(stale) if stale.is_dir() else stale.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="mar-stage-", dir=export_path) as tmp:
        stage, packaged = Path(tmp) / "files", Path(tmp) / "model-config.yaml"
        _stage(model_dir, model_files, stage)
        packaged.write_text(config_text)
        command = [
            console_script("torch-model-archiver"),
            "--model-name",
            model_name,
            "--version",
            "1.0",
            "--handler",
            str(HANDLER_PACKAGE / "sd_handler.py"),
            "--extra-files",
            str(stage),
            "--config-file",
            str(packaged),
            "--export-path",
            str(export_path),
            "--archive-format",
            archive_format,
        ]
        logger.info("packaging %s (%d files, %s) into %s", model_dir, len(model_files), archive_format, target)
        # The archiver copies the files into $TMPDIR/<model name>, removing what is there first: a
        # temporary directory of this build's own keeps two builds at once (two servers) apart.
        subprocess.run(command, check=True, env={**os.environ, "TMPDIR": tmp})
    stamp.write_text(fingerprint)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model-dir",
        type=Path,
        required=True,
        help="local diffusers directory, or a single-file .safetensors checkpoint",
    )
    parser.add_argument("--config", type=Path, default=MODEL_CONFIG, help="model-config.yaml to package")
    parser.add_argument("--export-path", type=Path, default=MODEL_STORE, help="model store to write to")
    parser.add_argument(
        "--gpus",
        type=int,
        help="GPUs of the host that will serve the archive (default: those visible here); 1 for a one-GPU pod",
    )
    parser.add_argument(
        "--archive-format",
        choices=["auto", "default", "no-archive"],
        default="auto",
        help="auto: a directory (no-archive) for models over 1 GiB, else a .mar",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    build(
        args.model_dir.resolve(), args.config.resolve(), args.export_path.resolve(), args.archive_format, gpus=args.gpus
    )


if __name__ == "__main__":
    main()
