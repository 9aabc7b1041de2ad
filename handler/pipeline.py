"""Build, optimize and run the diffusers text-to-image pipeline.

One function (``load_text_to_image``) builds the pipeline for the handler, the benchmarks and the
tests, so what is measured is what is served.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from diffusers import (
    AutoPipelineForText2Image,
    DDIMScheduler,
    DiffusionPipeline,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    PNDMScheduler,
)
from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0, SlicedAttnProcessor
from PIL.Image import Image
from torch._inductor.runtime.cache_dir_utils import cache_dir

from handler.batching import CallInputs, CallKey
from handler.config import HandlerSettings
from handler.metrics import CallTimings

logger = logging.getLogger(__name__)

# Scheduler class and the settings it needs on top of the model's scheduler config. PNDM skips its
# Runge-Kutta warm-up steps as Stable Diffusion's own PNDM configuration does (with them it needs at
# least 4 steps and runs 13 UNet calls for 4 steps).
SCHEDULERS = {
    "ddim": (DDIMScheduler, {}),
    "euler": (EulerDiscreteScheduler, {}),
    "euler_a": (EulerAncestralDiscreteScheduler, {}),
    "dpmpp_2m": (DPMSolverMultistepScheduler, {}),
    "pndm": (PNDMScheduler, {"skip_prk_steps": True}),
}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
ATTENTION_PROCESSORS = {"sdpa": AttnProcessor2_0, "vanilla": AttnProcessor}
ATTENTION_COMPONENTS = ("unet", "vae")


def resolve_device(setting: str, gpu_id: int | None = None) -> torch.device:
    """``auto`` is the GPU TorchServe assigned to this worker when there is one, else the CPU."""
    if setting == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", gpu_id or 0)
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if setting == "cuda":
        return torch.device("cuda", gpu_id or 0)
    return torch.device(setting)


def resolve_dtype(setting: str, device: torch.device) -> torch.dtype:
    """``auto`` is float16 on accelerators and float32 on the CPU (where half precision is slow)."""
    if setting == "auto":
        return torch.float32 if device.type == "cpu" else torch.float16
    return DTYPES[setting]


def _pipeline_source(settings: HandlerSettings, model_dir: str | Path) -> str:
    """A local directory when it exists; otherwise ``model_path`` is taken as a hub id."""
    local = settings.resolve_model_path(model_dir)
    if local.is_dir():
        return str(local)
    logger.warning("model_path %s is not a local directory; loading it as a hub id", settings.model_path)
    return settings.model_path


def _set_attention(pipeline: DiffusionPipeline, settings: HandlerSettings) -> None:
    processor_class = ATTENTION_PROCESSORS[settings.attention]
    for name in ATTENTION_COMPONENTS:
        getattr(pipeline, name).set_attn_processor(processor_class())
    if settings.attention_slicing:
        pipeline.enable_attention_slicing()


def attention_summary(pipeline: DiffusionPipeline, settings: HandlerSettings) -> str:
    """Check that every attention module runs the configured processor; return a summary.
    Attention slicing replaces the UNet's processors only."""
    configured = ATTENTION_PROCESSORS[settings.attention]
    expected = {"unet": SlicedAttnProcessor if settings.attention_slicing else configured, "vae": configured}
    wrong, counts = [], {}
    for component in ATTENTION_COMPONENTS:
        for module, processor in getattr(pipeline, component).attn_processors.items():
            name = expected[component].__name__
            counts[name] = counts.get(name, 0) + 1
            if not isinstance(processor, expected[component]):
                wrong.append(f"{component}.{module} ({type(processor).__name__}, expected {name})")
    if wrong:
        raise RuntimeError(f"{len(wrong)} attention modules run the wrong processor: {', '.join(sorted(wrong)[:5])}")
    return "+".join(f"{name} on {count} modules" for name, count in counts.items())


def _apply_memory_options(pipeline: DiffusionPipeline, settings: HandlerSettings, device: torch.device) -> None:
    if settings.vae_slicing:
        pipeline.vae.enable_slicing()
    if settings.vae_tiling:
        pipeline.vae.enable_tiling()
    if settings.cpu_offload == "none":
        pipeline.to(device)
        return
    if device.type != "cuda":
        raise ValueError(f"cpu_offload {settings.cpu_offload!r} needs a CUDA device, this worker runs on {device}")
    if settings.cpu_offload == "model":
        pipeline.enable_model_cpu_offload(gpu_id=device.index)
    else:
        pipeline.enable_sequential_cpu_offload(gpu_id=device.index)


def _apply_compile(pipeline: DiffusionPipeline, settings: HandlerSettings) -> None:
    options = settings.compile
    if not options.enabled:
        return
    if options.cache_dir:
        # Read by inductor at each compilation (Triton's cache follows it), so setting it here is enough.
        Path(options.cache_dir).mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = options.cache_dir
    kwargs = {"mode": options.mode, "fullgraph": options.fullgraph, "dynamic": options.dynamic}
    if "unet" in options.targets:
        pipeline.unet = torch.compile(pipeline.unet, **kwargs)
    if "vae_decoder" in options.targets:
        pipeline.vae.decode = torch.compile(pipeline.vae.decode, **kwargs)


def compile_cache_summary() -> str:
    """Where inductor caches compiled code, and how many graphs this process found there (hit) or
    compiled (miss); a restarted worker with a persisted cache shows hits only."""
    counters = torch._dynamo.utils.counters["inductor"]
    return f"dir={cache_dir()} fxgraph_cache_hit={counters['fxgraph_cache_hit']} fxgraph_cache_miss={counters['fxgraph_cache_miss']}"


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so that a clock read after it measures device time."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def native_size(pipeline: DiffusionPipeline) -> tuple[int, int]:
    """The resolution the model was trained at: UNet sample size times the VAE scale factor."""
    side = pipeline.unet.config.sample_size * pipeline.vae_scale_factor
    return side, side


class _StepClock:
    """Times the denoising steps of one call: from the first UNet call to each step's end, then
    to the end of the call (VAE decode and post-processing). With a device given, it is
    synchronized at each mark so that GPU time is measured, not launch time."""

    def __init__(self, synchronize: torch.device | None):
        self.synchronize = synchronize if synchronize is not None and synchronize.type == "cuda" else None
        self.marks: list[float] = []

    def _mark(self) -> None:
        if self.synchronize is not None:
            torch.cuda.synchronize(self.synchronize)
        self.marks.append(time.perf_counter())

    def unet_called(self, module, args) -> None:
        if not self.marks:
            self._mark()

    def step_ended(self, pipeline, step, timestep, callback_kwargs) -> dict:
        self._mark()
        return callback_kwargs

    def timings(self) -> CallTimings:
        self._mark()
        steps = [end - start for start, end in zip(self.marks, self.marks[1:-1])]
        return CallTimings(denoise_steps=steps, vae_decode=self.marks[-1] - self.marks[-2])


@dataclass
class TextToImage:
    """A loaded pipeline plus the schedulers requests may choose from."""

    pipeline: DiffusionPipeline
    device: torch.device
    dtype: torch.dtype
    description: str
    synchronize_steps: bool = True
    out_of_memory_above_pixels: int | None = None
    _schedulers: dict[str, object] = field(default_factory=dict)

    def _use_scheduler(self, name: str) -> None:
        if name not in self._schedulers:
            scheduler_class, overrides = SCHEDULERS[name]
            self._schedulers[name] = scheduler_class.from_config(self.pipeline.scheduler.config, **overrides)
        self.pipeline.scheduler = self._schedulers[name]

    def generate(self, key: CallKey, inputs: CallInputs) -> tuple[list[Image], CallTimings]:
        """Run one pipeline call; image ``i`` comes from a CPU generator seeded ``inputs.seeds[i]``,
        so it does not depend on its batchmates or on the device."""
        pixels = len(inputs.seeds) * key.width * key.height
        if self.out_of_memory_above_pixels is not None and pixels > self.out_of_memory_above_pixels:
            raise torch.OutOfMemoryError(
                f"simulated out of memory: {pixels} pixels in one call, fault_injection allows "
                f"{self.out_of_memory_above_pixels}"
            )
        self._use_scheduler(key.scheduler)
        generators = [torch.Generator("cpu").manual_seed(seed) for seed in inputs.seeds]
        clock = _StepClock(self.device if self.synchronize_steps else None)
        hook = self.pipeline.unet.register_forward_pre_hook(clock.unet_called)
        try:
            with torch.inference_mode():
                output = self.pipeline(
                    prompt=inputs.prompts,
                    negative_prompt=inputs.negative_prompts,
                    num_inference_steps=key.num_inference_steps,
                    guidance_scale=key.guidance_scale,
                    width=key.width,
                    height=key.height,
                    generator=generators,
                    output_type="pil",
                    callback_on_step_end=clock.step_ended,
                )
        finally:
            hook.remove()
        return output.images, clock.timings()

    def warm_up(self, key: CallKey, batch_size: int) -> float:
        """Generate one throw-away batch of this shape; return the seconds it took."""
        started = time.perf_counter()
        inputs = CallInputs(["warm-up"] * batch_size, [""] * batch_size, list(range(batch_size)), [0] * batch_size)
        self.generate(key, inputs)
        return time.perf_counter() - started


def load_text_to_image(settings: HandlerSettings, model_dir: str | Path, gpu_id: int | None = None) -> TextToImage:
    """Load the pipeline (safetensors only) and apply the configured optimizations."""
    device = resolve_device(settings.device, gpu_id)
    dtype = resolve_dtype(settings.dtype, device)
    if device.type == "cuda" and settings.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    pipeline = AutoPipelineForText2Image.from_pretrained(
        _pipeline_source(settings, model_dir), dtype=dtype, use_safetensors=True
    )
    pipeline.set_progress_bar_config(disable=True)
    _set_attention(pipeline, settings)
    if settings.channels_last:
        pipeline.unet.to(memory_format=torch.channels_last)
        pipeline.vae.to(memory_format=torch.channels_last)
    _apply_memory_options(pipeline, settings, device)
    attention = attention_summary(pipeline, settings)
    _apply_compile(pipeline, settings)
    description = (
        f"pipeline={type(pipeline).__name__} device={device} dtype={str(dtype).removeprefix('torch.')} "
        f"attention={attention} channels_last={settings.channels_last} "
        f"tf32={settings.tf32 and device.type == 'cuda'} attention_slicing={settings.attention_slicing} "
        f"vae_slicing={settings.vae_slicing} vae_tiling={settings.vae_tiling} cpu_offload={settings.cpu_offload} "
        f"compile={settings.compile.mode if settings.compile.enabled else 'off'}"
        f"{'(' + ','.join(settings.compile.targets) + ')' if settings.compile.enabled else ''}"
    )
    return TextToImage(
        pipeline, device, dtype, description, settings.metrics.synchronize_steps,
        settings.fault_injection.out_of_memory_above_pixels,
    )
