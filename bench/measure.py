"""Measure one pipeline variant in this process (the benchmark runs each variant in its own).

A fresh process per variant keeps measurements apart: peak memory starts from the loaded model,
``torch.compile`` starts from an empty in-memory cache (cold, or warm from the inductor cache on
disk), and a variant that crashes or runs out of memory costs only its own row.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import resource
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from diffusers import SD3Transformer2DModel, UNet2DConditionModel
from torch.utils.flop_counter import FlopCounterMode

from bench.jobs import generate
from bench.variants import by_name
from handler.config import HandlerSettings
from handler.engine.costs import ATTENTION_FORMULAS
from handler.engine.jobs import JobSpec
from handler.engine.loading import load_engine
from handler.engine.profiling import activities, summarize
from handler.engine.step_engine import StepEngine

logger = logging.getLogger(__name__)

PROMPTS = ("a red circle", "a small blue square", "a green triangle", "a large yellow circle")
MIB = 2**20


@dataclass(frozen=True)
class Workload:
    """What every variant generates: the same prompts, seeds, size, steps and scheduler."""

    model_dir: str
    device: str
    width: int
    height: int
    steps: int
    batch: int
    repeats: int
    guidance_scale: float = 7.5
    scheduler: str = "ddim"
    max_batch_limit: int = 0

    def specs(self, batch: int | None = None, steps: int | None = None) -> list[JobSpec]:
        """One job per image, as ``batch`` one-image requests: image k has prompt k (cycling) and seed k."""
        return [
            JobSpec(
                PROMPTS[index % len(PROMPTS)],
                None,
                (index,),
                self.width,
                self.height,
                steps or self.steps,
                self.scheduler,
                self.guidance_scale,
            )
            for index in range(batch or self.batch)
        ]

    def base_settings(self) -> HandlerSettings:
        return HandlerSettings(model_path=self.model_dir, device=self.device)


class PeakMemory:
    """Peak memory of the code run between ``reset`` and ``peak_mib``: the CUDA allocator's peak
    (weights included) on a GPU, the growth of the process's peak resident set on the CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.measure = "cuda_max_allocated" if device.type == "cuda" else "rss_peak_growth"
        self._rss_before = 0

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        self._rss_before = _status_kib("VmRSS")
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM, the peak resident set
        except OSError:
            self.measure = "rss_lifetime_peak_growth"

    def peak_mib(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / MIB
        return max(_status_kib("VmHWM") - self._rss_before, 0) / 1024


def _status_kib(field: str) -> int:
    """A memory field of /proc/self/status in KiB (ru_maxrss where /proc is missing)."""
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
        return int(match.group(1))
    except (OSError, AttributeError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def unet_flops(config: dict, rows: int, latent_height: int, latent_width: int, text_tokens: int) -> int:
    """FLOPs of one call of the UNet described by ``config``, counted with FlopCounterMode on the
    meta device (no weights, no arithmetic); attention as its two matrix products, as the worker's
    row costs count it (``ATTENTION_FORMULAS``)."""
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(config)
    latents = torch.empty(rows, unet.config.in_channels, latent_height, latent_width, device="meta")
    text = torch.empty(rows, text_tokens, unet.config.cross_attention_dim, device="meta")
    added = None
    if unet.config.addition_embed_type == "text_time":  # SDXL: pooled text embedding and six size/crop ids
        time_ids = 6
        pooled = unet.config.projection_class_embeddings_input_dim - time_ids * unet.config.addition_time_embed_dim
        added = {
            "text_embeds": torch.empty(rows, pooled, device="meta"),
            "time_ids": torch.empty(rows, time_ids, device="meta"),
        }
    with FlopCounterMode(display=False, custom_mapping=ATTENTION_FORMULAS) as counter:
        unet(latents, torch.zeros(rows, device="meta"), text, added_cond_kwargs=added)
    return counter.get_total_flops()


def transformer_flops(config: dict, rows: int, latent_height: int, latent_width: int, text_tokens: int) -> int:
    """FLOPs of one call of the SD 3 transformer described by ``config``, counted as ``unet_flops``
    counts."""
    with torch.device("meta"):
        transformer = SD3Transformer2DModel.from_config(config)
        inputs = {
            "hidden_states": torch.empty(rows, transformer.config.in_channels, latent_height, latent_width),
            "timestep": torch.zeros(rows),
            "encoder_hidden_states": torch.empty(rows, text_tokens, transformer.config.joint_attention_dim),
            "pooled_projections": torch.empty(rows, transformer.config.pooled_projection_dim),
        }
    with FlopCounterMode(display=False, custom_mapping=ATTENTION_FORMULAS) as counter:
        transformer(**inputs)
    return counter.get_total_flops()


def denoiser_call_flops(engine: StepEngine, workload: Workload) -> int:
    """FLOPs of one denoiser call of the workload (UNet or SD 3 transformer): its batch (doubled
    for guidance) at its latent size, with the family's text tokens (SD 3: CLIP's and T5's)."""
    pipeline = engine.pipeline
    scale = pipeline.vae_scale_factor
    rows = workload.batch * (2 if workload.guidance_scale > 1 else 1)
    size = (rows, workload.height // scale, workload.width // scale)
    if engine.family.denoiser_name == "transformer":
        text_tokens = pipeline.tokenizer.model_max_length + engine.family.max_sequence_length
        return transformer_flops(pipeline.transformer.config, *size, text_tokens)
    return unet_flops(pipeline.unet.config, *size, pipeline.tokenizer.model_max_length)


def largest_batch(engine: StepEngine, workload: Workload) -> dict:
    """The most images one forward of this shape fits (CUDA): doubling until out of memory, then
    bisection. Two steps per try: memory peaks the same at every step."""

    def fits(size: int) -> bool:
        try:
            generate(engine, workload.specs(size, steps=2))
            return True
        except RuntimeError as error:
            if _out_of_memory(error):
                return False
            raise
        finally:
            torch.cuda.empty_cache()

    fitting, failing = 0, None
    size = workload.batch
    while size <= workload.max_batch_limit:
        if not fits(size):
            failing = size
            break
        fitting, size = size, size * 2
    if failing is None:
        return {"max_batch": fitting, "max_batch_bounded_by_limit": True}
    while failing - fitting > 1:
        middle = (fitting + failing) // 2
        fitting, failing = (middle, failing) if fits(middle) else (fitting, middle)
    return {"max_batch": fitting, "max_batch_bounded_by_limit": False}


def profile(engine: StepEngine, specs: list[JobSpec], latency_s: float, top: int = 8) -> dict:
    """Where one call's time goes (``handler.engine.profiling``): on CUDA the kernels' share of the
    unprofiled call's ``latency_s``, the host syncs (the step clock adds one event wait at the end of
    the call) and the kernels taking the most time; on a CPU the operators taking the most CPU time."""
    with torch.profiler.profile(activities=activities(engine.device)) as profiler:
        started = time.perf_counter()
        generate(engine, specs)
        wall_s = time.perf_counter() - started
    summary = summarize(profiler, engine.device, latency_s, specs[0].num_inference_steps, top)
    return summary | {"wall_s": wall_s, "latency_s": latency_s}


def _out_of_memory(error: Exception) -> bool:
    """Out of memory as CUDA reports it, or as cuDNN and cuBLAS do near the limit."""
    return isinstance(error, torch.OutOfMemoryError) or any(
        sign in str(error) for sign in ("out of memory", "CUDNN_STATUS", "CUBLAS_STATUS_ALLOC_FAILED")
    )


def first_step_path(images_path: Path) -> Path:
    """Where a variant's first-step latent change is saved, beside its images."""
    return images_path.with_name(f"{images_path.stem}-first-step.npy")


def first_step_change(engine: StepEngine, specs: list[JobSpec]) -> np.ndarray:
    """How much the first step moves the jobs' latents (float32): one denoiser forward's work, before
    later steps amplify a rounding difference (with random weights, SDXL's 30 steps make any
    difference of float16's size a different image)."""
    jobs = engine.start(specs)
    before = torch.cat([job.latents for job in jobs]).float().cpu()
    engine.step(jobs)
    return (torch.cat([job.latents for job in jobs]).float().cpu() - before).numpy()


def save_first_step(engine: StepEngine, specs: list[JobSpec], images_path: Path) -> dict:
    """``first_step_change`` saved beside the images (an earlier run's removed first: a failure
    leaves none to pass for this run's)."""
    path = first_step_path(images_path)
    path.unlink(missing_ok=True)
    np.save(path, first_step_change(engine, specs))
    return {}


def run_variant(
    variant_name: str,
    workload: Workload,
    images_path: Path,
    count_flops: bool,
    with_profile: bool = False,
    search_max_batch: bool = False,
) -> dict:
    """Load, warm up (compiling, for compiled variants) and time one variant; save its images."""
    variant = by_name(variant_name)
    started = time.perf_counter()
    engine = load_engine(variant.settings(workload.base_settings()), ".")
    load_s = time.perf_counter() - started
    specs = workload.specs()
    memory = PeakMemory(engine.device)

    first_started = time.perf_counter()
    generate(engine, specs)
    first_call_s = time.perf_counter() - first_started
    latencies, step_times = [], []
    memory.reset()
    for _ in range(workload.repeats):
        call_started = time.perf_counter()
        decoded, seconds = generate(engine, specs)
        latencies.append(time.perf_counter() - call_started)
        step_times.extend(seconds)
    peak_mib = memory.peak_mib()
    np.save(images_path, np.stack([np.asarray(image) for job in decoded for image in job.images]))
    median_latency = statistics.median(latencies)
    result = {
        "description": engine.description,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "load_s": load_s,
        "first_call_s": first_call_s,
        "warmup_overhead_s": max(first_call_s - median_latency, 0.0),
        "latency_s": median_latency,
        "latencies_s": latencies,
        "images_per_s": workload.batch / median_latency,
        "unet_it_s": 1 / statistics.median(step_times),
        "peak_memory_mib": peak_mib,
        "memory_measure": memory.measure,
        "compile_counters": {
            name: count for name, count in torch._dynamo.utils.counters["inductor"].items() if "cache" in name
        },
        "cudagraph_skips": torch._dynamo.utils.counters["inductor"].get("cudagraph_skips", 0),
    }
    if count_flops:
        result["unet_call_flops"] = denoiser_call_flops(engine, workload)
    # Extras after the measurements: a failure here is reported beside them, not instead of them.
    result.update(_extra("first_step", lambda: save_first_step(engine, specs, images_path)))
    if with_profile:
        result.update(_extra("profile", lambda: {"profile": profile(engine, specs, median_latency)}))
    if engine.device.type == "cuda" and workload.max_batch_limit and search_max_batch:
        result.update(_extra("max_batch", lambda: largest_batch(engine, workload)))
    return result


def error_text(error: Exception) -> str:
    """An exception as a result file reports it: its type and message, at most 2000 characters."""
    return f"{type(error).__name__}: {error}".strip()[:2000]


def _extra(name: str, measure) -> dict:
    try:
        return measure()
    except Exception as error:  # noqa: BLE001 - reported in the result
        traceback.print_exc()
        return {f"{name}_error": error_text(error)}


def main() -> None:
    parser = argparse.ArgumentParser(description="measure one pipeline variant (run by bench.pipeline)")
    parser.add_argument("--variant", required=True)
    parser.add_argument("--workload", required=True, help="Workload as JSON")
    parser.add_argument("--images", type=Path, required=True, help=".npy file for the generated images")
    parser.add_argument("--result", type=Path, required=True, help="JSON file for the measurements")
    parser.add_argument("--count-flops", action="store_true")
    parser.add_argument("--profile", action="store_true", help="profile one more call (torch.profiler)")
    parser.add_argument("--max-batch", action="store_true", help="on CUDA, search the largest batch that fits")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    workload = Workload(**json.loads(args.workload))
    try:
        result = {
            "status": "ok",
            **run_variant(args.variant, workload, args.images, args.count_flops, args.profile, args.max_batch),
        }
    except Exception as error:  # the benchmark reports a failed variant and goes on with the next
        traceback.print_exc()
        result = {"status": "failed", "error": error_text(error)}
    args.result.write_text(json.dumps(result, indent=2))
    sys.exit(0 if result["status"] == "ok" else 1)


if __name__ == "__main__":
    main()
