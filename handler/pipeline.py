"""Load and optimize the diffusers text-to-image pipeline for the step engine.

One function (``load_engine``) builds the engine for the handler, the benchmarks and the tests,
so what is measured is what is served.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch
from diffusers import AutoPipelineForText2Image
from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0, SlicedAttnProcessor
from torch._inductor.runtime.cache_dir_utils import cache_dir

from handler.config import HandlerSettings
from handler.engine import StepEngine
from handler.families import Pipeline, family_of
from handler.loras import LoraLibrary

logger = logging.getLogger(__name__)

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


def _set_attention(pipeline: Pipeline, settings: HandlerSettings) -> None:
    processor_class = ATTENTION_PROCESSORS[settings.attention]
    for name in ATTENTION_COMPONENTS:
        getattr(pipeline, name).set_attn_processor(processor_class())
    if settings.attention_slicing:
        pipeline.enable_attention_slicing()


def attention_summary(pipeline: Pipeline, settings: HandlerSettings) -> str:
    """Check that every attention module runs the configured processor; return a summary.
    Attention slicing replaces the UNet's processors only."""
    configured = ATTENTION_PROCESSORS[settings.attention]
    expected = {"unet": SlicedAttnProcessor if settings.attention_slicing else configured, "vae": configured}
    wrong: list[str] = []
    counts: dict[str, int] = {}
    for component in ATTENTION_COMPONENTS:
        for module, processor in getattr(pipeline, component).attn_processors.items():
            name = expected[component].__name__
            counts[name] = counts.get(name, 0) + 1
            if not isinstance(processor, expected[component]):
                wrong.append(f"{component}.{module} ({type(processor).__name__}, expected {name})")
    if wrong:
        raise RuntimeError(f"{len(wrong)} attention modules run the wrong processor: {', '.join(sorted(wrong)[:5])}")
    return "+".join(f"{name} on {count} modules" for name, count in counts.items())


def _apply_memory_options(pipeline: Pipeline, settings: HandlerSettings, device: torch.device) -> None:
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


def _apply_compile(pipeline: Pipeline, settings: HandlerSettings) -> None:
    options = settings.compile
    if not options.enabled:
        return
    if options.cache_dir:
        # Read by inductor at each compilation (Triton's cache follows it), so setting it here is enough.
        Path(options.cache_dir).mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = options.cache_dir
    compile_ = functools.partial(torch.compile, mode=options.mode, fullgraph=options.fullgraph, dynamic=options.dynamic)
    if "unet" in options.targets:
        pipeline.unet = compile_(pipeline.unet)
    if "vae_decoder" in options.targets:
        pipeline.vae.decode = compile_(pipeline.vae.decode)


def compile_cache_summary() -> str:
    """Where inductor caches compiled code, and how many graphs this process found there (hit) or
    compiled (miss); a restarted worker with a persisted cache shows hits only."""
    counters = torch._dynamo.utils.counters["inductor"]
    hits, misses = counters["fxgraph_cache_hit"], counters["fxgraph_cache_miss"]
    return f"dir={cache_dir()} fxgraph_cache_hit={hits} fxgraph_cache_miss={misses}"


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so that a clock read after it measures device time."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_cached_memory() -> None:
    """Hand cached blocks back to the device after running out of memory, before a retry."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def native_size(pipeline: Pipeline) -> tuple[int, int]:
    """The resolution the model was trained at: UNet sample size times the VAE scale factor."""
    side = pipeline.unet.config.sample_size * pipeline.vae_scale_factor
    return side, side


def _apply_safety_checker(pipeline: Pipeline, settings: HandlerSettings) -> str:
    """Keep the model's safety checker unless ``handler.safety_checker`` is false; say which."""
    if getattr(pipeline, "safety_checker", None) is None:
        return "none (the model ships none)"
    if not settings.safety_checker:
        pipeline.safety_checker = None
        logger.warning("the model's safety checker is OFF (handler.safety_checker: false)")
        return "off (handler.safety_checker: false)"
    return "on"


def load_engine(settings: HandlerSettings, model_dir: str | Path, gpu_id: int | None = None) -> StepEngine:
    """Load the pipeline (safetensors only), detect its family (refusing any other pipeline),
    apply the configured optimizations and return the step engine over it."""
    device = resolve_device(settings.device, gpu_id)
    dtype = resolve_dtype(settings.dtype, device)
    if device.type == "cuda" and settings.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    pipeline = AutoPipelineForText2Image.from_pretrained(
        _pipeline_source(settings, model_dir), dtype=dtype, use_safetensors=True
    )
    pipeline.set_progress_bar_config(disable=True)
    family = family_of(pipeline, device, dtype)
    safety = _apply_safety_checker(pipeline, settings)
    _set_attention(pipeline, settings)
    if settings.channels_last:
        pipeline.unet.to(memory_format=torch.channels_last)
        pipeline.vae.to(memory_format=torch.channels_last)
    _apply_memory_options(pipeline, settings, device)
    attention = attention_summary(pipeline, settings)
    _apply_compile(pipeline, settings)
    description = (
        f"family={family.name} pipeline={type(pipeline).__name__} device={device} "
        f"dtype={str(dtype).removeprefix('torch.')} vae_dtype={str(pipeline.vae.dtype).removeprefix('torch.')} "
        f"safety_checker={safety} attention={attention} channels_last={settings.channels_last} "
        f"tf32={settings.tf32 and device.type == 'cuda'} attention_slicing={settings.attention_slicing} "
        f"vae_slicing={settings.vae_slicing} vae_tiling={settings.vae_tiling} cpu_offload={settings.cpu_offload} "
        f"compile={settings.compile.mode if settings.compile.enabled else 'off'}"
        f"{'(' + ','.join(settings.compile.targets) + ')' if settings.compile.enabled else ''}"
    )
    compiled_unet = settings.compile.enabled and "unet" in settings.compile.targets
    # diffusers switches LoRAs only on ModelMixin components, which a compiled UNet no longer is.
    off_because = "handler.compile compiles the UNet, whose LoRA layers diffusers cannot switch"
    loras = LoraLibrary(
        pipeline, settings.loras.directory(), settings.loras.max_loaded, off_because if compiled_unet else None
    )
    return StepEngine(pipeline, family, device, dtype, description, loras, settings.fault_injection)
