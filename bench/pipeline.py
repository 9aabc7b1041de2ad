"""`make bench-pipeline`: what each pipeline optimization buys, measured side by side in one run.

Every variant (``bench.variants``) generates the same prompts and seeds, each in its own process
(``bench.measure``); compiled variants run twice, cold (empty inductor cache) and warm (the cache
the cold run persisted, as a restarted worker finds it). Then an attention micro-benchmark at SD
1.5's shapes. Writes JSON, a Markdown table and a PNG chart under ``reports/``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

import diffusers
import numpy as np
import torch

from bench import sd15
from bench.measure import Workload, first_step_path
from bench.report import write_report
from bench.variants import BASELINE, VARIANT_NAMES, Variant, select
from handler.engine.loading import resolve_device
from server.paths import DEFAULT_MODEL_DIR, RANDOM_MODEL_DIR, REPORTS, ROOT

logger = logging.getLogger("bench-pipeline")

MODELS = {"default": DEFAULT_MODEL_DIR, "tiny": RANDOM_MODEL_DIR, "sd15": sd15.MODEL_DIR}
WORKLOAD_FILE = "workload.json"  # the workload the variants in a scratch directory were measured with
WARM_KEYS = ("first_call_s", "warmup_overhead_s", "latency_s", "compile_counters")  # a warm run's figures


def image_distance(images: np.ndarray, baseline: np.ndarray) -> dict:
    """Max absolute difference (0-255) and PSNR (dB; None when identical) of uint8 images."""
    difference = images.astype(np.float64) - baseline.astype(np.float64)
    mse = float(np.mean(difference**2))
    return {
        "max_abs_diff": int(np.abs(difference).max()),
        "psnr_db": None if mse == 0 else float(10 * np.log10(255.0**2 / mse)),
    }


def python_module(
    module: str, arguments: list[str], env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *arguments],
        cwd=ROOT,
        env={**os.environ, **env},
        timeout=timeout,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


class Runner:
    """Runs variants in fresh processes and collects their results; images are compared with
    ``baseline``'s, whose process also counts the UNet's FLOPs (and profiles a call, with ``profile``)."""

    def __init__(
        self,
        workload: Workload,
        scratch: Path,
        timeout: float,
        baseline: str = BASELINE,
        profile: bool = False,
        caches: Path | None = None,
        max_batch_for: set[str] | None = None,
        reuse: bool = False,
        quick: bool = False,
    ):
        self.workload = workload
        self.quick = quick  # leaves out what a quick run skips (Variant.skip_reason)
        self.scratch = scratch
        self.timeout = timeout
        self.baseline = baseline
        self.profile = profile
        self.caches = caches or scratch  # inductor caches, one per variant; runners may share them
        self.max_batch_for = max_batch_for  # variants whose largest batch is searched (None: every eager one)
        scratch.mkdir(parents=True, exist_ok=True)
        # With ``reuse``, a variant already measured in ``scratch`` for the same workload (an earlier
        # run stopped midway, or another benchmark's run) is taken as it is, not measured again.
        recorded = scratch / WORKLOAD_FILE
        self.reuse = reuse and recorded.is_file() and json.loads(recorded.read_text()) == asdict(workload)
        recorded.write_text(json.dumps(asdict(workload)))

    def _extras(self, variant: Variant) -> list[str]:
        extra = ["--count-flops"] + (["--profile"] if self.profile else []) if variant.name == self.baseline else []
        searched = not variant.compiled if self.max_batch_for is None else variant.name in self.max_batch_for
        return extra + (["--max-batch"] if searched and self.workload.max_batch_limit else [])

    def measure(self, variant: Variant, run: str, env: dict[str, str], extra: list[str]) -> dict:
        result_path, images_path = self.scratch / f"{variant.name}-{run}.json", self.scratch / f"{variant.name}.npy"
        # A crashed process must not pass for an earlier one. The result is written after the images,
        # so removing it is enough; the images stay, as a failed warm run keeps the cold run's.
        result_path.unlink(missing_ok=True)
        arguments = [
            "--variant",
            variant.name,
            "--workload",
            json.dumps(asdict(self.workload)),
            "--images",
            str(images_path),
            "--result",
            str(result_path),
            *extra,
        ]
        try:
            finished = python_module("bench.measure", arguments, env, self.timeout)
        except subprocess.TimeoutExpired:
            return {"status": "failed", "error": f"timed out after {self.timeout:.0f} s"}
        if not result_path.is_file():
            return {"status": "failed", "error": f"exit {finished.returncode}: {finished.stdout[-2000:]}"}
        result = json.loads(result_path.read_text())
        if result["status"] != "ok":
            logger.warning("%s (%s) failed:\n%s", variant.name, run, finished.stdout[-4000:])
        return result

    def variant(self, variant: Variant, device: torch.device, warm: bool = True) -> dict:
        """One variant's measurements (cold, and for compiled variants with ``warm`` a second run
        on the inductor cache the first left), or why it was skipped."""
        reason = variant.skip_reason(device, self.quick)
        if reason:
            return {"status": "skipped", "reason": reason}
        reused = self._reused(variant, warm)
        if reused is not None:
            logger.info("%s: measured earlier for this workload in %s; reused", variant.name, self.scratch)
            return reused
        cache = self.caches / f"inductor-{variant.name}"
        if warm:
            shutil.rmtree(cache, ignore_errors=True)  # the cold run starts from an empty cache
        env = {"TORCHINDUCTOR_CACHE_DIR": str(cache), **variant.env}
        result = self.measure(variant, "cold", env, self._extras(variant))
        if warm and variant.compiled and result["status"] == "ok":
            warm_result = self.measure(variant, "warm", env, [])
            result["warm"] = _warm_part(warm_result)
        return result

    def _reused(self, variant: Variant, warm: bool) -> dict | None:
        """The result this scratch holds for ``variant`` (with its warm run where one is due and the
        extras this runner asks for), or None."""
        cold = self.scratch / f"{variant.name}-cold.json"
        if not self.reuse or not cold.is_file() or not (self.scratch / f"{variant.name}.npy").is_file():
            return None
        result = json.loads(cold.read_text())
        wanted = {"--count-flops": "unet_call_flops", "--profile": "profile", "--max-batch": "max_batch"}
        if result["status"] != "ok" or any(wanted[extra] not in result for extra in self._extras(variant)):
            return None
        if warm and variant.compiled:
            warm_file = self.scratch / f"{variant.name}-warm.json"
            if not warm_file.is_file():
                return None
            result["warm"] = _warm_part(json.loads(warm_file.read_text()))
        return result

    def variants(
        self,
        variants: list[Variant],
        device: torch.device,
        warm: bool = True,
        on_result: Callable[[dict[str, dict]], None] | None = None,
    ) -> dict[str, dict]:
        """Every variant in turn, with progress, compared with the baseline (speed-up, image
        distance) as soon as measured; ``on_result`` gets the results so far after each."""
        results: dict[str, dict] = {}
        for number, variant in enumerate(variants, 1):
            started = time.perf_counter()
            results[variant.name] = result = self.variant(variant, device, warm)
            logger.info(
                "[%d/%d] %-28s %s (%.0f s)",
                number,
                len(variants),
                variant.name,
                summary(result),
                time.perf_counter() - started,
            )
            compare_with_baseline(results, self.scratch, self.baseline)
            if on_result:
                on_result(results)
        return results


def _warm_part(warm_result: dict) -> dict:
    """What a variant's result keeps of its warm run: its figures, or why it failed."""
    return {key: warm_result[key] for key in WARM_KEYS} if warm_result["status"] == "ok" else warm_result


def first_step_distance(step: np.ndarray, reference: np.ndarray) -> float | None:
    """The relative L2 distance of a first-step latent change to ``reference``'s (0: the same; None
    where the reference did not move)."""
    norm = float(np.linalg.norm(reference))
    return float(np.linalg.norm(step - reference)) / norm if norm else None


def to_reference(results: dict[str, dict], scratch: Path, reference: str) -> dict[str, dict]:
    """The image distance of each measured variant (``reference`` included) to ``reference``'s
    images in ``scratch``, and where both saved one, the distance of their first steps'
    (``first_step_rel_diff``); empty until ``reference`` measured."""
    if results.get(reference, {}).get("status") != "ok":
        return {}
    images = np.load(scratch / f"{reference}.npy")
    reference_step = first_step_path(scratch / f"{reference}.npy")
    first_step = np.load(reference_step) if reference_step.is_file() else None
    distances = {}
    for name in (name for name, result in results.items() if result["status"] == "ok"):
        distances[name] = image_distance(np.load(scratch / f"{name}.npy"), images)
        own = first_step_path(scratch / f"{name}.npy")
        if first_step is not None and own.is_file():
            distances[name]["first_step_rel_diff"] = first_step_distance(np.load(own), first_step)
    return distances


def compare_with_baseline(results: dict[str, dict], scratch: Path, baseline_name: str = BASELINE) -> None:
    """Speed-up, image distance and achieved TFLOP/s of each measured variant, in place."""
    baseline = results.get(baseline_name, {})
    if baseline.get("status") != "ok":
        return
    distances = to_reference(results, scratch, baseline_name)
    flops = baseline.get("unet_call_flops")
    for name, result in results.items():
        if result["status"] != "ok":
            continue
        result["speedup"] = baseline["latency_s"] / result["latency_s"]
        result.update(distances[name])
        if flops:
            result["unet_tflops"] = flops * result["unet_it_s"] / 1e12


def environment(device: torch.device) -> dict:
    driver = None
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        driver = _nvidia_driver()
    else:
        cpu = (
            next(
                (
                    line.split(":", 1)[1].strip()
                    for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")
                ),
                platform.processor(),
            )
            if Path("/proc/cpuinfo").exists()
            else platform.processor()
        )
        name = f"{cpu}, {os.cpu_count()} cores"
    return {
        "device": str(device),
        "device_name": name,
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "python": platform.python_version(),
        **({"driver": driver, "cuda": torch.version.cuda} if device.type == "cuda" else {}),
    }


def _nvidia_driver() -> str | None:
    """The NVIDIA driver's version, from nvidia-smi where it is installed."""
    try:
        return (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            )
            .stdout.strip()
            .splitlines()[0]
        )
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def build_workload(args: argparse.Namespace, device: torch.device) -> Workload:
    """The command line's workload; unset sizes follow the model (SD 1.5 on a CPU: reduced)."""
    model_dir = MODELS.get(args.model, Path(args.model))
    if args.model == "sd15":
        model_dir = sd15.ensure_model()
        side, steps = (sd15.NATIVE_SIDE, 50) if device.type == "cuda" else (256, 4)
    elif args.quick:
        side, steps = 64, 1
    else:
        side, steps = 64, 25
    return Workload(
        model_dir=str(Path(model_dir).resolve()),
        device=args.device,
        width=args.resolution or side,
        height=args.resolution or side,
        steps=args.steps or steps,
        batch=args.batch,
        repeats=args.repeats or (1 if args.quick else 3),
        max_batch_limit=0 if args.quick else args.max_batch_limit,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="default", help=f"{', '.join(MODELS)} or a diffusers directory (default: default)"
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"])
    parser.add_argument(
        "--resolution", type=int, help="image side in pixels (default: 64; sd15: 512 on GPU, 256 on CPU)"
    )
    parser.add_argument("--steps", type=int, help="denoising steps (default: 25; sd15: 50 on GPU, 4 on CPU)")
    parser.add_argument("--batch", type=int, default=1, help="one-image requests stepped together")
    parser.add_argument("--repeats", type=int, help="timed calls per variant after the warm-up call (default 3)")
    parser.add_argument(
        "--variants", nargs="*", help=f"subset of {', '.join(VARIANT_NAMES)} (the baseline always runs)"
    )
    parser.add_argument(
        "--max-batch-limit", type=int, default=64, help="largest batch the GPU max-batch search tries; 0: skip"
    )
    parser.add_argument("--attention-repeats", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one variant process may take")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="CI mode: the random tiny model on the CPU, 64x64, 1 step, 1 repeat, one compiled variant",
    )
    parser.add_argument("--output-dir", type=Path, default=REPORTS)
    parser.add_argument("--name", help="report file stem (default: pipeline-<model>-<device>)")
    parser.add_argument(
        "--scratch",
        type=Path,
        help="keep images and results here and reuse the variants already measured there for the same workload "
        "(a run stopped midway, or make bench-gpu's variants section: <its scratch>/variants); default: a "
        "temporary directory",
    )
    args = parser.parse_args(argv)
    if args.quick and args.model == "default":
        args.model = "tiny"
    if args.quick and args.device == "auto":
        args.device = "cpu"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    device = resolve_device(args.device)
    workload = build_workload(args, device)
    variants = select(args.variants)
    name = args.name or f"pipeline-{args.model if args.model in MODELS else Path(args.model).name}-{device.type}"
    logger.info("workload: %s on %s; %d variants", workload, device, len(variants))
    with contextlib.ExitStack() as stack:
        scratch = args.scratch or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-pipeline-")))
        runner = Runner(workload, scratch, args.timeout, reuse=args.scratch is not None, quick=args.quick)
        results = runner.variants(variants, device)
        logger.info("attention micro-benchmark at SD 1.5 shapes")
        attention_path = scratch / "attention.json"
        python_module(
            "bench.attention",
            ["--device", str(device), "--repeats", str(args.attention_repeats), "--result", str(attention_path)],
            {},
            args.timeout,
        ).check_returncode()
        attention = json.loads(attention_path.read_text())
    report = {
        "workload": asdict(workload),
        "model": args.model,
        "quick": args.quick,
        "environment": environment(device),
        "baseline": BASELINE,
        "variants": [
            {"name": variant.name, "summary": variant.summary, **results[variant.name]} for variant in variants
        ],
        "attention": attention,
    }
    paths = write_report(report, args.output_dir, name)
    logger.info("report: %s", ", ".join(str(path) for path in paths))


def summary(result: dict) -> str:
    if result["status"] == "skipped":
        return f"skipped: {result['reason']}"
    if result["status"] != "ok":
        return f"FAILED: {result['error'][:200]}"
    warm = result.get("warm", {})
    compile_note = (
        f", compile cold {result['warmup_overhead_s']:.1f} s warm {warm.get('warmup_overhead_s', float('nan')):.1f} s"
        if warm
        else ""
    )
    return (
        f"{result['latency_s']:.3f} s/call, {result['unet_it_s']:.1f} UNet it/s, "
        f"peak {result['peak_memory_mib']:.0f} MiB{compile_note}"
    )


if __name__ == "__main__":
    main()
