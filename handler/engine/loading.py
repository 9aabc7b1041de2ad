"""Load and optimize the diffusers text-to-image pipeline for the step engine.

One function (``load_engine``) builds the engine for the handler, the benchmarks and the tests,
so what is measured is what is served.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoPipelineForText2Image
from diffusers.loaders import TextualInversionLoaderMixin
from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0, SlicedAttnProcessor
from torch._inductor.runtime.cache_dir_utils import cache_dir

from handler.adapters.controlnets import ControlNetLibrary
from handler.adapters.embeddings import EmbeddingLibrary
from handler.adapters.lora_slots import SlotLoras
from handler.adapters.loras import LoraLibrary
from handler.checkpoints.single_file import checkpoint_file, load_single_file, load_vae_file
from handler.config import CompileSettings, HandlerSettings, guided_at
from handler.engine.decoding import DecodeStream
from handler.engine.step_engine import StepEngine
from handler.families import Family, Pipeline, StableDiffusion3Family, family_of
from handler.families.base import RegionCompiler, rows_marked
from handler.families.deep_cache import DeepCacheHooks, is_unet
from handler.families.first_block_cache import FirstBlockHooks, is_transformer

logger = logging.getLogger(__name__)
# The graphs a compiled region's code may keep (dynamo's recompile limit) (``_region_compiler``).
REGION_GRAPHS = 32
# Whether torch.compile takes a recompile limit of its own (``compile_with_limit``): not in torch 2.11,
# the lent GPU machines' own.
_COMPILE_TAKES_RECOMPILE_LIMIT = "recompile_limit" in inspect.signature(torch.compile).parameters

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
ATTENTION_PROCESSORS = {"sdpa": AttnProcessor2_0, "vanilla": AttnProcessor}


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


def _load_pipeline(settings: HandlerSettings, model_dir: str | Path, dtype: torch.dtype) -> Pipeline:
    """The pipeline of a single-file checkpoint (``handler.checkpoints``), else of a diffusers
    directory; with the VAE of ``handler.vae.file`` where one is set."""
    single = checkpoint_file(settings.resolve_model_path(model_dir))
    if single is not None:
        pipeline = load_single_file(single, settings.checkpoint, dtype, settings.text_encoder_3)
    else:
        source = _pipeline_source(settings, model_dir)
        pipeline = AutoPipelineForText2Image.from_pretrained(
            source, dtype=dtype, use_safetensors=True, **_without_t5(source, settings)
        )
    if settings.vae.file:
        upcast = {} if settings.vae.force_upcast is None else {"force_upcast": settings.vae.force_upcast}
        pipeline.vae = load_vae_file(Path(settings.vae.file), {**pipeline.vae.config, **upcast}, pipeline.vae.dtype)
    return pipeline


def _set_attention(family: Family, settings: HandlerSettings) -> None:
    """The configured processor on the VAE and on a denoiser that takes it (slicing: on the UNet)."""
    if settings.attention_slicing and family.own_attention:
        raise ValueError(
            f"attention_slicing is not available for {family.name} models: their denoiser keeps its own attention "
            f"processor ({family.own_attention.__name__})"
        )
    processor_class = ATTENTION_PROCESSORS[settings.attention]
    for component in ("vae",) if family.own_attention else ("vae", family.denoiser_name):
        getattr(family.pipeline, component).set_attn_processor(processor_class())
    if settings.attention_slicing:
        family.pipeline.enable_attention_slicing()


def _attention_components(family: Family, settings: HandlerSettings) -> dict[str, type]:
    """The processor each component's attention modules must run: the configured one; attention
    slicing's on the UNet; the family's own on a denoiser that keeps them."""
    configured = ATTENTION_PROCESSORS[settings.attention]
    denoiser = SlicedAttnProcessor if settings.attention_slicing else configured
    return {family.denoiser_name: family.own_attention or denoiser, "vae": configured}


def attention_summary(family: Family, settings: HandlerSettings) -> str:
    """Check that every attention module runs the processor it should; return a summary."""
    wrong: list[str] = []
    counts: dict[str, int] = {}
    for component, expected in _attention_components(family, settings).items():
        for module, processor in getattr(family.pipeline, component).attn_processors.items():
            counts[expected.__name__] = counts.get(expected.__name__, 0) + 1
            if not isinstance(processor, expected):
                wrong.append(f"{component}.{module} ({type(processor).__name__}, expected {expected.__name__})")
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


def _loras_off(settings: HandlerSettings) -> str | None:
    """Why this pipeline serves no LoRAs, or None."""
    if settings.cpu_offload == "sequential":  # the per-row path reads LoRA weights accelerate keeps off the device
        return "handler.cpu_offload sequential keeps the LoRA weights off the device outside their own layers"
    return None


def _embeddings_off(pipeline: Pipeline) -> str | None:
    """Why this pipeline serves no textual-inversion embeddings, or None."""
    if not isinstance(pipeline, TextualInversionLoaderMixin):
        return f"{type(pipeline).__name__} takes no textual-inversion embeddings (SD 1.x, 2.x and SDXL do)"
    return None


def dynamic_rows(settings: HandlerSettings) -> bool:
    """Whether compiled graphs (the denoiser, its step cache's regions, the VAE decoder) take their
    rows dynamic from their first call of two rows or more (``mark_rows``): where
    ``compile.dynamic`` is unset and ``max_images_per_call`` is over 1. A dynamic graph costs more
    to compile than a static one, so a worker that steps one guided image at a time keeps static
    graphs."""
    return settings.compile.dynamic is None and settings.max_images_per_call > 1


def _apply_compile(family: Family, settings: HandlerSettings) -> None:
    options = settings.compile
    if not options.enabled:
        return
    if options.cache_dir:
        # Read by inductor at each compilation (Triton's cache follows it), so setting it here is enough.
        Path(options.cache_dir).mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = options.cache_dir
    if options.denoiser:
        # In place: the denoiser stays the pipeline's model, which diffusers loads LoRAs into (their
        # weights then go to handler.adapters.lora_slots). Inference only: PEFT freezing the weights at a
        # LoRA load changes nothing a guard checks.
        family.denoiser.requires_grad_(False)
        if options.backend == "cudagraphs":
            from handler.engine.cuda_graphs import eager_kernels_in_cuda_graphs  # inductor's modules: only here

            family.denoiser.compile(
                backend=eager_kernels_in_cuda_graphs, fullgraph=options.fullgraph, dynamic=options.dynamic
            )
        else:
            family.denoiser.compile(mode=options.mode, fullgraph=options.fullgraph, dynamic=options.dynamic)
    if options.decoder:
        # The images of every job finishing in a step decode in one call: any count, one graph for
        # two or more (warm-up decodes one image and two), without CUDA graphs (one recorded per count,
        # while serving, would make every request in flight wait).
        decode = torch.compile(
            family.pipeline.vae.decode,
            mode=without_cuda_graphs(options.mode),
            fullgraph=options.fullgraph,
            dynamic=options.dynamic,
        )
        family.pipeline.vae.decode = rows_marked(decode) if dynamic_rows(settings) else decode


def compiled_summary(options: CompileSettings) -> str:
    """What is compiled and how: ``off``, inductor's mode or ``cudagraphs``, and the targets compiled."""
    if not options.enabled:
        return "off"
    targets = [target for target in options.targets if target != "vae_decoder" or options.decoder]
    return f"{options.mode if options.backend == 'inductor' else options.backend}({','.join(targets)})"


def without_cuda_graphs(mode: str) -> str:
    """``torch.compile``'s ``mode`` without CUDA graphs, for code called at any row count (the step
    cache's regions, the VAE decoder): cudagraph trees would record a graph per count."""
    return {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}.get(mode, mode)


def _region_compiler(options: CompileSettings, marked: bool) -> RegionCompiler | None:
    """How a compiled denoiser's step caches compile its regions (None: the denoiser is eager): in
    the configured mode without CUDA graphs (regions run between eager Python, on sub-batches of any
    row count: a graph per count would be recorded), with their rows dynamic from the first call of
    two rows or more (``marked``: ``dynamic_rows``) and other sizes static until they change, and
    never a full graph (a region past its limit runs eagerly rather than failing the forward).

    The blocks of one kind share one code, so one list of graphs: one per structure (SD 3.5's blocks
    with a second attention, the last block without its text stream) and per width, with and without
    LoRA rows, each for one row and for more, then one with the latents' size dynamic once it changes.
    That can pass dynamo's default limit of 8 a code, so regions get ``REGION_GRAPHS``. The cudagraphs
    backend's regions stay eager: it generates no kernels, and records graphs only."""
    if not options.denoiser or options.backend != "inductor":
        return None
    dynamic = None if options.dynamic is False else options.dynamic
    compile_ = functools.partial(
        compile_with_limit, limit=REGION_GRAPHS, mode=without_cuda_graphs(options.mode), dynamic=dynamic
    )
    return (lambda forward: rows_marked(compile_(forward))) if marked else compile_


def compile_with_limit(function: Callable[..., Any], limit: int, **options: Any) -> Callable[..., Any]:
    """``torch.compile(function, **options)`` keeping up to ``limit`` graphs of its code (dynamo's
    recompile limit) and leaving the process's limit to other code: torch.compile's own
    ``recompile_limit`` where torch has it, else the process's limit raised for each call's length
    (a process-wide setting: right while one thread calls compiled code, the step engine's)."""
    if _COMPILE_TAKES_RECOMPILE_LIMIT:
        return torch.compile(function, **{**options, "recompile_limit": limit})  # not in torch's overloads
    compiled = torch.compile(function, **options)

    @functools.wraps(function)
    def limited(*args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(recompile_limit=limit):
            return compiled(*args, **kwargs)

    return limited


def inductor_cache_counts() -> tuple[int, int]:
    """Graphs this process found in inductor's cache (hits), and graphs it compiled (misses). Read
    anew each time: a compile may replace the counters' dict an earlier reader holds."""
    counters = torch._dynamo.utils.counters["inductor"]
    return counters["fxgraph_cache_hit"], counters["fxgraph_cache_miss"]


def compile_cache_summary() -> str:
    """Where inductor caches compiled code, and how many graphs this process found there (hit) or
    compiled (miss); a restarted worker with a persisted cache shows hits only."""
    hits, misses = inductor_cache_counts()
    return f"dir={cache_dir()} fxgraph_cache_hit={hits} fxgraph_cache_miss={misses}"


def cuda_graph_skips() -> int:
    """Compiled graphs this process runs without recording CUDA graphs where its mode or backend
    asked for them (torch logs each one's reason: an input mutated, an operation on the CPU, ...)."""
    return int(torch._dynamo.utils.counters["inductor"]["cudagraph_skips"])


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so that a clock read after it measures device time."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reserved_memory(device: torch.device) -> int | None:
    """Bytes the caching allocator holds on ``device`` (CUDA graphs' pools included); None off CUDA."""
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else None


def use_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device. The CUDA runtime's is per thread,
    device 0 until set: a worker TorchServe assigned another GPU would make a context on GPU 0 (some
    hundreds of MiB there) at a thread's first call without a device of its own, such as an event's
    synchronize."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def release_cached_memory() -> None:
    """Hand cached blocks back to the device after running out of memory, before a retry."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _apply_safety_checker(pipeline: Pipeline, settings: HandlerSettings) -> str:
    """Keep the model's safety checker unless ``handler.safety_checker`` is false; say which."""
    if getattr(pipeline, "safety_checker", None) is None:
        return "none (the model ships none)"
    if not settings.safety_checker:
        pipeline.safety_checker = None
        logger.warning("the model's safety checker is OFF (handler.safety_checker: false)")
        return "off (handler.safety_checker: false)"
    return "on"


def _without_t5(source: str, settings: HandlerSettings) -> dict[str, None]:
    """``from_pretrained`` arguments that leave out an SD 3.x model's T5 encoder where
    ``handler.text_encoder_3`` is false or the directory was saved without one (none for a model of
    another family, which has no T5)."""
    index = Path(source) / "model_index.json"
    config = json.loads(index.read_text()) if index.is_file() else {}
    sd3 = config.get("_class_name") == StableDiffusion3Family.pipeline_class.__name__
    saved_without = sd3 and (config.get("text_encoder_3") or [None])[0] is None
    if settings.text_encoder_3 and not saved_without:
        return {}
    if not sd3:
        logger.warning("handler.text_encoder_3: false ignored: %s is not an SD 3.x pipeline", config.get("_class_name"))
        return {}
    why = "the model directory has none" if saved_without else "handler.text_encoder_3: false"
    logger.warning("serving without the T5 text encoder (%s): zero T5 embeddings", why)
    return {"text_encoder_3": None, "tokenizer_3": None}


def lora_slots(settings: HandlerSettings, denoiser: torch.nn.Module, device: torch.device) -> SlotLoras:
    """The compiled denoiser's LoRA slots. Rows that gather their slots take the most any row of a
    forward holds (a size marked dynamic: one graph for all), unless the denoiser's graphs are
    static: CUDA graphs are recorded per size, and ``compile.dynamic: false`` asks for static
    shapes. Then every row takes as many slots as a request may hold LoRAs, at most as many as are
    loaded: ``min(max_loaded, max_loras_per_request)``."""
    loras = settings.loras
    replayed = settings.compile.cuda_graphs(device.type)
    static = replayed or settings.compile.dynamic is False
    per_row = min(loras.max_loaded, settings.limits.max_loras_per_request) if static else None
    return SlotLoras(denoiser, loras.max_loaded, loras.slot_rank, loras.slot_design, per_row, replayed)


def load_engine(settings: HandlerSettings, model_dir: str | Path, gpu_id: int | None = None) -> StepEngine:
    """Load the pipeline (safetensors only), detect its family (refusing any other pipeline),
    apply the configured optimizations and return the step engine over it."""
    device = resolve_device(settings.device, gpu_id)
    use_device(device)  # the stepping thread's; the encoder threads bind theirs (handler.service.loops)
    dtype = resolve_dtype(settings.dtype, device)
    if device.type == "cuda" and settings.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    pipeline = _load_pipeline(settings, model_dir, dtype)
    pipeline.set_progress_bar_config(disable=True)
    family = family_of(pipeline, device, dtype, settings.max_sequence_length)
    safety = _apply_safety_checker(pipeline, settings)
    _set_attention(family, settings)
    if settings.channels_last:
        family.denoiser.to(memory_format=torch.channels_last)
        pipeline.vae.to(memory_format=torch.channels_last)
    _apply_memory_options(pipeline, settings, device)
    attention = attention_summary(family, settings)
    off_because, directory = _loras_off(settings), settings.loras.directory()
    slots = None
    if settings.compile.denoiser and directory is not None and off_because is None:
        slots = lora_slots(settings, family.denoiser, device)
        logger.info(
            "LoRA slots for the compiled %s: %d slots of rank %d (%s) on %d Linear layers, %.1f MiB",
            family.denoiser_name,
            slots.slots,
            slots.rank,
            slots.design,
            len(slots.layers),
            slots.bytes() / 2**20,
        )
    # Step caching per row wraps the denoiser's blocks; on a compiled denoiser, they run compiled apart.
    regions = _region_compiler(settings.compile, dynamic_rows(settings))
    deep_cache = DeepCacheHooks(family.denoiser, regions) if is_unet(family.denoiser) else None
    first_block = FirstBlockHooks(family.denoiser, regions) if is_transformer(family.denoiser) else None
    _apply_compile(family, settings)
    row_counts = settings.compile.row_counts(device.type, guided_at(settings.defaults.guidance_scale))
    text_encoder_3 = (
        "" if not hasattr(pipeline, "text_encoder_3") else f" text_encoder_3={pipeline.text_encoder_3 is not None}"
    )
    decode_stream = DecodeStream.on(device, settings.decode_stream)
    description = (
        f"family={family.name} pipeline={type(pipeline).__name__} denoiser={family.denoiser_name}{text_encoder_3} "
        f"device={device} "
        f"dtype={str(dtype).removeprefix('torch.')} vae_dtype={str(pipeline.vae.dtype).removeprefix('torch.')} "
        f"safety_checker={safety} attention={attention} channels_last={settings.channels_last} "
        f"tf32={settings.tf32 and device.type == 'cuda'} attention_slicing={settings.attention_slicing} "
        f"vae_slicing={settings.vae_slicing} vae_tiling={settings.vae_tiling} cpu_offload={settings.cpu_offload} "
        f"compile={compiled_summary(settings.compile)}"
        f" pad_rows={','.join(map(str, row_counts)) or 'off'}"
        f" step_cache={'deep' if deep_cache else 'first_block' if first_block else 'off'}"
        f"{'(compiled regions)' if regions and (deep_cache or first_block) else ''}"
        f" decode_stream={decode_stream.setting}"
    )
    loras = LoraLibrary(pipeline, family.denoiser, directory, settings.loras.max_loaded, off_because, slots)
    controlnets = ControlNetLibrary(
        family,
        settings.controlnets.directory(),
        settings.controlnets.max_loaded,
        device,
        dtype,
        every_forward=settings.compile.denoiser,
    )
    if controlnets.every_forward:
        logger.info(
            "ControlNets on the compiled %s: every forward takes residuals (zeros without one)", family.denoiser_name
        )
    embeddings = EmbeddingLibrary(
        pipeline, settings.embeddings.directory(), settings.embeddings.max_loaded, _embeddings_off(pipeline)
    )
    return StepEngine(
        pipeline,
        family,
        device,
        dtype,
        description,
        loras,
        controlnets,
        settings.fault_injection,
        row_counts,
        settings.compile.cuda_graphs(device.type),
        deep_cache,
        first_block,
        embeddings,
        dynamic_rows=settings.compile.denoiser and dynamic_rows(settings),
        compiled_decoder=settings.compile.decoder,
        decode_stream=decode_stream,
    )
