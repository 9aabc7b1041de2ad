"""Typed handler settings, read from the ``handler:`` section of ``model-config.yaml``."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

# The UNet families' scheduler names (SD 1.x/2.x, SDXL), then every scheduler name a request may give;
# each family serves some of them (``FamilyRules``).
UnetSchedulerName = Literal[
    "ddim",
    "euler",
    "euler_a",
    "lms",
    "lms_karras",
    "heun",
    "dpm2",
    "dpm2_karras",
    "dpm2_a",
    "dpm2_a_karras",
    "dpmpp_2m",
    "dpmpp_2m_karras",
    "dpmpp_2m_sde",
    "dpmpp_2m_sde_karras",
    "unipc",
    "pndm",
]
SchedulerName = Literal[UnetSchedulerName, "flow_match_euler"]
UNET_SCHEDULERS: tuple[SchedulerName, ...] = get_args(UnetSchedulerName)
OutputFormat = Literal["png", "jpeg", "webp"]
SlotDesign = Literal["gathered", "stacked"]  # handler.adapters.lora_slots
ResponseFormat = Literal["image", "json"]

# The largest seed a request may carry (and the range of seeds drawn for requests without one).
MAX_SEED = 2**32 - 1
# TorchServe's responseTimeout where model-config.yaml sets none (ModelConfig.java), in seconds.
TORCHSERVE_RESPONSE_TIMEOUT = 120
# Share of responseTimeout a request may take in the worker by default: the rest answers a dynamic
# batch (decode, encode) before TorchServe's timeout kills the worker with the batch in flight.
REQUEST_TIMEOUT_SHARE = 0.9

# The prompts of a pipeline's second and third text encoders (SDXL's and SD 3.x's CLIP-G, SD 3.x's T5),
# as diffusers names them, by the encoder that reads them.
OTHER_PROMPTS = {"prompt_2": 2, "negative_prompt_2": 2, "prompt_3": 3, "negative_prompt_3": 3}


# A request's skip-layer guidance, in diffusers' names: the blocks, then the settings its SkipLayerGuidance defaults.
SKIP_LAYER_FIELDS = (
    "skip_guidance_layers",
    "skip_layer_guidance_scale",
    "skip_layer_guidance_start",
    "skip_layer_guidance_stop",
)


# A request's own schedule, in diffusers' names (``retrieve_timesteps``): the timesteps, or the sigmas.
CUSTOM_SCHEDULE_FIELDS = ("timesteps", "sigmas")
# The schedulers whose sigmas end with the final sigma, one more than the steps they run
# (EulerDiscreteScheduler.set_timesteps); flow matching appends its own final 0.
SIGMAS_WITH_FINAL: frozenset[SchedulerName] = frozenset({"euler"})
# The largest first sigma a custom Euler schedule may start from: its latents (the noise times it) stay
# well within float16 (65504).
MAX_SIGMA = 1000.0
# One problem with a request's field: an error type, its message template and the template's values.
Problem = tuple[str, str, dict[str, Any]]


Pair = tuple[int, int]
# The largest size or crop offset a request may condition on (ComfyUI's MAX_RESOLUTION; float16 time
# ids hold integers up to 65504 only).
MAX_CONDITIONED_SIDE = 16384


@dataclass(frozen=True)
class SizeConditioning:
    """SDXL's micro-conditioning as a request gives it (None: left out): what its pipelines turn into
    the UNet's six time ids per row (``handler.families.sdxl``)."""

    original_size: Pair | None = None
    crops_coords_top_left: Pair | None = None
    target_size: Pair | None = None
    negative_original_size: Pair | None = None
    negative_crops_coords_top_left: Pair | None = None
    negative_target_size: Pair | None = None


# SDXL's size and crop conditioning, in diffusers' names: (height, width) pairs, crops (top, left).
SIZE_CONDITIONING_FIELDS = tuple(field.name for field in dataclasses.fields(SizeConditioning))


# The blocks of a request's (or the operator's default) skip_guidance_layers, numbered from 0.
SkipLayers = list[Annotated[int, Field(ge=0)]]


@dataclass(frozen=True)
class SkipLayerGuidance:
    """SD 3.x's skip-layer guidance (``StableDiffusion3Pipeline``'s ``skip_guidance_layers``,
    ``skip_layer_guidance_scale``, ``_start`` and ``_stop``, diffusers 0.42.1, with its defaults):
    at the steps ``i`` of ``n`` with ``n * start < i < n * stop``, the guided noise gains ``scale``
    times the prompt's noise less that of a forward with the transformer blocks ``layers`` skipped."""

    layers: tuple[int, ...]
    scale: float = 2.8
    start: float = 0.01
    stop: float = 0.2

    def acts(self, step: int, steps: int) -> bool:
        """Whether it acts at step ``step`` (from 0) of ``steps``, as ``__call__``'s ``should_skip_layers``."""
        return steps * self.start < step < steps * self.stop


@dataclass(frozen=True)
class FamilyRules:
    """What a model family allows in a request, as its family module (``handler.families``) states
    it: the schedulers, the grid width and height must be on (the VAE's scale times the denoiser's
    patch size), and how its image-to-image pipelines round the steps an input image runs."""

    family: str = "SD 1.x"
    schedulers: tuple[SchedulerName, ...] = UNET_SCHEDULERS
    own_scheduler: SchedulerName = "ddim"  # the model's own: what a request gets where the default is not allowed
    grid: int = 8
    # "steps": int(steps x strength) steps run (SD 1.x/2.x and SDXL's get_timesteps); "start": the
    # first step skipped is rounded down instead (SD 3.x's), so a positive strength always runs one.
    strength_rounding: Literal["steps", "start"] = "steps"
    max_side: int | None = None  # the largest width or height the denoiser takes (None: any)
    controlnets: bool = True  # whether its pipelines take ControlNets (every family's)
    # The most denoising steps its schedulers take: a UNet's schedule samples the model's training
    # timesteps (fewer by 2: more break DDIM, PNDM or DPM++ 2M), None where it is continuous (flow matching).
    max_steps: int | None = None
    cache_branches: int = 0  # DeepCache branches its denoiser serves (0: none; a UNet: 3 a down block)
    first_block_cache: bool = False  # whether its denoiser serves first-block caching (an SD 3.x transformer)
    # The most CLIP layers a prompt may skip (``clip_skip``): each CLIP text encoder keeps one
    # (SD 1.x's CLIP ViT-L/14, 12 layers, from its last hidden states).
    max_clip_skip: int = 11
    guidance_rescale: bool = True  # whether its text-to-image pipeline takes guidance_rescale (the UNet families')
    # The text encoders a request's prompts address (prompt, and OTHER_PROMPTS by their encoder): those
    # the model is served with (SD 1.x/2.x: 1, SDXL: 2, SD 3.x: 3, 2 without T5).
    text_encoders: int = 1
    # Whether its unguided rows are zeros where a request has no negative_prompt (SDXL's
    # force_zeros_for_empty_prompt): then negative_prompt_2 alone would not be encoded.
    zeros_without_negative: bool = False
    # The transformer blocks a request's skip_guidance_layers may name (SD 3.x: its blocks; 0: none,
    # skip-layer guidance is not served).
    transformer_blocks: int = 0
    size_conditioning: bool = False  # whether it takes SDXL's size and crop conditioning (original_size, ...)
    # What each scheduler takes of a custom schedule (CUSTOM_SCHEDULE_FIELDS): what the family's
    # pipeline and the scheduler's set_timesteps both take on the model's scheduler config.
    custom_schedules: tuple[tuple[SchedulerName, tuple[str, ...]], ...] = (
        ("euler", ("timesteps", "sigmas")),
        ("heun", ("timesteps",)),
        ("dpmpp_2m", ("timesteps",)),
        ("dpmpp_2m_sde", ("timesteps",)),
    )
    train_timesteps: int = 1000  # the model's training timesteps: a custom timestep is one of 0 .. this - 1
    # The largest sigma of the model's training schedule (Euler's sigma at its last timestep: SD's
    # scaled-linear betas); a custom Euler schedule has one sigma at most at or above it.
    max_sigma: float = 14.6146
    # The schedulers a request's eta acts on: those whose step takes it, where the family's pipeline
    # passes it (``prepare_extra_step_kwargs``: DDIM's).
    eta_schedulers: tuple[SchedulerName, ...] = ("ddim",)
    # The request fields a request with ControlNets may not carry: what the family's ControlNet
    # pipelines take none of (SD 3.x's take no input image, skip-layer guidance or step cache).
    controlnet_excludes: tuple[str, ...] = ()
    # The schedulers that run two denoiser calls a step but the first (order 2: Heun's and DPM2's).
    two_call_schedulers: tuple[SchedulerName, ...] = ("heun", "dpm2", "dpm2_karras", "dpm2_a", "dpm2_a_karras")

    def skip_layers_problem(self, layers: list[int]) -> Problem | None:
        """What is wrong with skip-layer guidance over ``layers`` on this family's transformer (an error
        type, its message template naming ``skip_guidance_layers`` and the template's values); None:
        nothing. The request's rule and the operator's default share it."""
        blocks = self.transformer_blocks
        if len(layers) > blocks:
            return (
                "too_long",
                "skip_guidance_layers lists {count} blocks: this {family} model's transformer has {blocks}",
                {"count": len(layers), "family": self.family, "blocks": blocks},
            )
        outside = sorted({layer for layer in layers if layer >= blocks})
        if outside:
            return (
                "block_out_of_range",
                "skip_guidance_layers names {outside}: this {family} model's transformer has {blocks} blocks, "
                "0 to {last}",
                {"outside": outside, "family": self.family, "blocks": blocks, "last": blocks - 1},
            )
        return None

    def schedulers_taking(self, field: str) -> list[SchedulerName]:
        """The schedulers that take a custom schedule's ``field`` (``timesteps`` or ``sigmas``)."""
        return [name for name, fields in self.custom_schedules if field in fields]

    def schedule_steps(self, field: str, scheduler: str, entries: int) -> int:
        """The steps a custom schedule of ``entries`` ``field`` values runs on ``scheduler``:
        one per value, but for sigmas with the final one (``SIGMAS_WITH_FINAL``)."""
        return entries - 1 if field == "sigmas" and scheduler in SIGMAS_WITH_FINAL else entries

    def schedule_problem(self, field: str, scheduler: SchedulerName, values: list[float]) -> Problem | None:
        """What is wrong with a custom schedule (``field``: timesteps or sigmas) on ``scheduler``:
        one it takes, strictly decreasing (from the noisiest step) and within its range, sigmas as
        the scheduler reads them (float32); None: nothing."""
        taking = self.schedulers_taking(field)
        if scheduler not in taking:
            takers = " or ".join(taking)
            advice = (
                "{takers} does: name it, or leave {field} out" if takers else "nor do its others: leave {field} out"
            )
            return (
                "custom_schedule_unavailable",
                "scheduler {scheduler} takes no custom {field} on this {family} model (diffusers' set_timesteps); "
                + advice,
                {"scheduler": scheduler, "field": field, "family": self.family, "takers": takers},
            )
        final = field == "sigmas" and scheduler in SIGMAS_WITH_FINAL
        if final and len(values) < 2:
            return (
                "too_short",
                "{scheduler}'s sigmas end with the final sigma (diffusers' EulerDiscreteScheduler): give at least "
                "2, for one step",
                {"scheduler": scheduler},
            )
        if field == "sigmas":
            with np.errstate(over="ignore"):  # as set_timesteps reads them; beyond float32, inf
                values = np.asarray(values, dtype=np.float64).astype(np.float32).tolist()
        for index, value in enumerate(values):
            if not self._in_range(field, final, index, len(values), value):
                return (
                    "schedule_out_of_range",
                    "{field} entry {index} is {value}: {allowed}",
                    {"field": field, "index": index, "value": value, "allowed": self._schedule_range(field, final)},
                )
            if index and value >= values[index - 1]:
                return (
                    "schedule_not_decreasing",
                    "{field} must decrease strictly, from the noisiest step: entry {index} ({value}) is not below "
                    "the one before it ({before})",
                    {"field": field, "index": index, "value": value, "before": values[index - 1]},
                )
        return None

    def _in_range(self, field: str, final: bool, index: int, count: int, value: float) -> bool:
        """Whether value ``index`` of ``count`` of a custom schedule is one its scheduler reads
        (``final``: sigmas that end with the final sigma)."""
        if field == "timesteps":
            return 0 <= value < self.train_timesteps
        if not final:
            return 0 < value <= 1
        if index == 0:
            return 0 < value <= MAX_SIGMA
        return (value > 0 or index == count - 1 and value == 0) and value < self.max_sigma

    def _schedule_range(self, field: str, final: bool) -> str:
        """What a custom schedule's values may be, in words."""
        if field == "timesteps":
            return f"this model's timesteps run from {self.train_timesteps - 1} (the noisiest) to 0"
        if final:
            return (
                f"Euler's sigmas are above 0 (the last, the final sigma, may be 0); the first at most {MAX_SIGMA:g}, "
                f"the others below this model's largest, {self.max_sigma:.4f} (two at or above it would both run "
                "at its last timestep)"
            )
        return "flow matching's sigmas are above 0 and at most 1 (the noisiest)"

    def serves(self, cache: StepCache) -> bool:
        """Whether the denoiser serves a step cache (off always)."""
        if cache.mode == "deep":
            return cache.branch < self.cache_branches
        return cache.mode == "off" or self.first_block_cache

    def served_caches(self) -> str:
        """The step caches its denoiser serves, in words."""
        if self.cache_branches:
            return f"DeepCache branches 0..{self.cache_branches - 1}"
        return "first-block caching" if self.first_block_cache else "no step cache"

    def image_steps(self, steps: int, strength: float) -> int:
        """Of ``steps`` denoising steps, how many an input image at ``strength`` runs (``get_timesteps``)."""
        if self.strength_rounding == "steps":
            return min(int(steps * strength), steps)
        return steps - int(max(steps - min(steps * strength, steps), 0))

    def default_scheduler(self, configured: SchedulerName) -> SchedulerName:
        """The configured default where this family serves it, else the model's own scheduler."""
        return configured if configured in self.schedulers else self.own_scheduler


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RequestLimits(_Section):
    """Bounds every request is checked against before it reaches the pipeline."""

    max_prompt_chars: int = Field(
        1000, ge=1, description="longest prompt or negative prompt (of any text encoder), in characters"
    )
    max_inference_steps: int = Field(100, ge=1, description="most denoising steps a request may ask for")
    max_guidance_scale: float = Field(30.0, gt=0, description="largest classifier-free guidance scale")
    min_side: int = Field(64, ge=8, multiple_of=8, description="smallest width or height, in pixels")
    max_side: int = Field(1024, ge=8, multiple_of=8, description="largest width or height, in pixels")
    max_pixels: int = Field(1024 * 1024, ge=64, description="largest width x height of one image")
    max_images_per_request: int = Field(4, ge=1, description="most images one request may ask for")
    max_loras_per_request: int = Field(4, ge=0, description="most LoRA adapters one request may combine")
    max_lora_scale: float = Field(4.0, gt=0, description="largest |scale| of a LoRA adapter in a request")
    max_controlnets_per_request: int = Field(
        3, ge=0, description="most ControlNets one request may combine (diffusers' MultiControlNet)"
    )
    max_controlnet_scale: float = Field(
        2.0, gt=0, description="largest scale (controlnet_conditioning_scale, from 0) of a ControlNet in a request"
    )
    max_input_pixels: int = Field(
        2048 * 2048,
        ge=64,
        description="largest input image (image-to-image, inpainting), in pixels, checked before decoding",
    )

    @model_validator(mode="after")
    def _sides_are_ordered(self) -> RequestLimits:
        if self.min_side > self.max_side:
            raise ValueError(f"min_side {self.min_side} is larger than max_side {self.max_side}")
        return self


class RequestDefaults(_Section):
    """Values used for the fields a request leaves out."""

    negative_prompt: str | None = None
    clip_skip: int | None = Field(None, ge=0, description="CLIP layers a prompt skips (diffusers' clip_skip)")
    num_inference_steps: int = Field(25, ge=1)
    guidance_scale: float = Field(7.5, ge=0)
    guidance_rescale: float = Field(
        0.0,
        ge=0,
        le=1,
        description="rescales guided noise toward the prompt's own spread (diffusers' guidance_rescale)",
    )
    skip_guidance_layers: SkipLayers | None = Field(
        None,
        min_length=1,
        description="SD 3.x: the blocks skip-layer guidance skips for a guided request that leaves "
        "skip_guidance_layers out (SD 3.5 Medium's card: [7, 8, 9]); an unguided request gets none, and one "
        "that sends null opts out",
    )
    width: int | None = Field(None, ge=8, multiple_of=8, description="None: the model's native size")
    height: int | None = Field(None, ge=8, multiple_of=8, description="None: the model's native size")
    num_images_per_prompt: int = Field(1, ge=1)
    scheduler: SchedulerName = "ddim"
    output_format: OutputFormat = "png"
    response_format: ResponseFormat = "image"
    strength: float = Field(
        0.8, gt=0, le=1, description="image-to-image: how much of the schedule the image goes through"
    )


def guided_at(guidance_scale: float) -> bool:
    """Classifier-free guidance (two denoiser rows an image) at this scale, as the pipelines decide
    it: above 1."""
    return guidance_scale > 1


def absolute_dir(value: str | None, setting: str, why: str) -> str | None:
    """A directory setting with ``~`` and ``$VARIABLES`` expanded, which must then be absolute."""
    if value is None:
        return None
    expanded = os.path.expanduser(os.path.expandvars(value))
    if not os.path.isabs(expanded):
        raise ValueError(f"{setting} must be an absolute path (got {value!r}); {why}")
    return expanded


# Where LoRA adapters and ControlNets are read from when handler.loras.dir / handler.controlnets.dir
# is unset (make serve, the image, Kubernetes).
LORA_DIR_ENV = "LORA_DIR"
CONTROLNET_DIR_ENV = "CONTROLNET_DIR"
EMBEDDINGS_DIR_ENV = "EMBEDDINGS_DIR"


class _ServedDirectory(_Section):
    """A directory of what requests may name: ``dir`` (absolute), else an environment variable."""

    section: ClassVar[str]  # its name under handler:
    env: ClassVar[str]  # the variable read where ``dir`` is unset
    dir: str | None = None

    @field_validator("dir")
    @classmethod
    def _dir_is_absolute(cls, value: str | None) -> str | None:
        return absolute_dir(value, f"{cls.section}.dir", "the worker runs in the unpacked archive")

    def directory(self) -> Path | None:
        """The directory: ``dir``, else the environment variable, else none."""
        chosen = self.dir or os.environ.get(self.env) or None
        return Path(chosen) if chosen else None


class LoraSettings(_ServedDirectory):
    """LoRA adapters served per request from a directory (``handler.adapters.loras``)."""

    section: ClassVar[str] = "loras"
    env: ClassVar[str] = LORA_DIR_ENV
    dir: str | None = Field(
        None,
        description="absolute directory of LoRA .safetensors files (a LoRA's name is its file stem); None: "
        f"${LORA_DIR_ENV} where set, else no LoRAs",
    )
    max_loaded: int = Field(8, ge=1, description="adapters kept in memory (least recently used evicted)")
    slot_rank: int = Field(
        32,
        ge=1,
        le=1024,
        description="with a compiled denoiser: the largest LoRA rank served; every Linear layer of its transformer "
        "blocks holds max_loaded slots of this rank (memory: (in + out) x max_loaded x slot_rank per layer)",
    )
    slot_design: SlotDesign = Field(
        "gathered",
        description="with a compiled denoiser: gathered, each row multiplies by its own adapters' slots (the most "
        "any row of a forward holds, at least 2; where the graphs are static, min(max_loaded, "
        "max_loras_per_request)); stacked, every row by every slot (max_loaded x slot_rank ranks per row)",
    )


class ControlNetSettings(_ServedDirectory):
    """ControlNets served per request from a directory (``handler.adapters.controlnets``), every family."""

    section: ClassVar[str] = "controlnets"
    env: ClassVar[str] = CONTROLNET_DIR_ENV
    dir: str | None = Field(
        None,
        description="absolute directory of ControlNets, each a diffusers directory (config.json + safetensors) named "
        "by its directory name or a single .safetensors file named by its stem; None: "
        f"${CONTROLNET_DIR_ENV} where set, else no ControlNets",
    )
    max_loaded: int = Field(2, ge=1, description="ControlNets kept in memory (least recently used evicted)")


class CheckpointSettings(_Section):
    """A single-file checkpoint's configs and prediction type, where the detected ones are not wanted."""

    config: str | None = Field(
        None,
        description="absolute directory of the model's configs and tokenizers (model_index.json and each component's "
        "config, as diffusers' from_single_file(config=) takes) replacing the shipped ones; None: the shipped "
        "configs of the detected architecture",
    )
    prediction_type: Literal["auto", "epsilon", "v_prediction"] = Field(
        "auto",
        description="auto: an A1111 .yaml beside the file (model.params.parameterization), else the file's v_pred "
        "marker, else for SD 2.x the spread of one norm's bias (ComfyUI's test), else the configs' scheduler",
    )
    text_encoders: str | None = Field(
        None,
        description="absolute diffusers directory (of the same architecture) whose text_encoder*/ and tokenizer*/ "
        "supply the text encoders a file lacks (SD 3.x files often ship without T5, or without any)",
    )

    @field_validator("config", "text_encoders")
    @classmethod
    def _directory_is_absolute(cls, value: str | None, info: ValidationInfo) -> str | None:
        return absolute_dir(value, f"checkpoint.{info.field_name}", "the worker runs in the unpacked archive")

    def prediction(self) -> Literal["epsilon", "v_prediction"] | None:
        """The prediction type set, or None (``auto``)."""
        return None if self.prediction_type == "auto" else self.prediction_type


class VaeSettings(_Section):
    """A VAE file replacing the model's own VAE (A1111's ``models/VAE``), for a directory or a single file alike."""

    file: str | None = Field(
        None,
        description="absolute path of a VAE .safetensors (LDM keys, as A1111 keeps them, or diffusers'), loaded "
        "with the model's own VAE config; None: the model's VAE",
    )
    force_upcast: bool | None = Field(
        None,
        description="decode in float32 where the model runs float16 (SDXL's VAE asks it); false for a VAE made for "
        "float16 such as SDXL's fp16-fix; None: the model's own VAE config says",
    )

    @field_validator("file")
    @classmethod
    def _file_is_absolute(cls, value: str | None) -> str | None:
        return absolute_dir(value, "vae.file", "the worker runs in the unpacked archive")


class EmbeddingSettings(_ServedDirectory):
    """Textual-inversion embeddings a prompt names (``handler.adapters.embeddings``), SD 1.x/2.x and SDXL:
    ``dir``, an absolute directory of ``.safetensors`` files (an embedding's name is its file stem,
    used where a prompt or negative prompt says it), else ``$EMBEDDINGS_DIR``, else none."""

    section: ClassVar[str] = "embeddings"
    env: ClassVar[str] = EMBEDDINGS_DIR_ENV
    max_loaded: int = Field(16, ge=1, description="embeddings kept in memory (least recently used evicted)")


# Names of the denoiser among compile targets: "unet" and "transformer" are the same target, the
# family's denoiser (SD 1.x/2.x and SDXL's UNet, SD 3.x's transformer).
DENOISER_TARGETS = frozenset({"unet", "transformer"})


class CompileSettings(_Section):
    """``torch.compile`` of the denoiser (UNet or transformer) and the VAE decoder."""

    enabled: bool = False
    backend: Literal["inductor", "cudagraphs"] = Field(
        "inductor",
        description="inductor: torch.compile generates the denoiser's and VAE decoder's kernels (mode says how); "
        "cudagraphs: the denoiser's own kernels, traced by dynamo and replayed as CUDA graphs (seconds to trace "
        "instead of minutes to compile; the VAE decoder and the step cache's regions stay eager, and off CUDA "
        "nothing is recorded)",
    )
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = Field(
        "default", description="inductor's mode (the cudagraphs backend takes default only)"
    )
    targets: tuple[Literal["unet", "transformer", "vae_decoder"], ...] = Field(
        ("unet", "vae_decoder"),
        description="unet (or its synonym transformer): the family's denoiser, SD 3.x's transformer included; "
        "vae_decoder: the VAE's decode",
    )
    fullgraph: bool = False
    dynamic: bool | None = None
    pad_rows: Literal["auto", "on", "off"] = Field(
        "auto",
        description="pad each denoiser forward's rows to the least of graph_rows at or above them (the padding rows "
        "dropped from the result), so the compiled denoiser keeps one CUDA graph per latent shape and count instead "
        "of one per distinct row count; auto: where it replays CUDA graphs (on CUDA: the cudagraphs backend, or "
        "inductor's modes reduce-overhead and max-autotune); either way a compiled denoiser of a model whose "
        "defaults are guided pads a single row to two",
    )
    graph_rows: tuple[PositiveInt, ...] = Field(
        (1, 2, 4, 8, 16, 24, 32),
        description="the row counts forwards are padded to (a forward above the largest runs unpadded)",
    )
    cache_dir: str | None = Field(
        None,
        description="absolute directory for inductor's compiled-code cache (TORCHINDUCTOR_CACHE_DIR), kept across "
        "worker restarts so a new worker loads kernels instead of compiling them; None: the environment's "
        "TORCHINDUCTOR_CACHE_DIR, else torch's default under the temp directory",
    )

    @model_validator(mode="after")
    def _cudagraphs_records_the_denoiser(self) -> CompileSettings:
        if self.backend != "cudagraphs":
            return self
        if self.mode != "default":
            raise ValueError(
                f"compile.mode {self.mode} is inductor's; compile.backend cudagraphs records the eager kernels "
                "and takes mode default"
            )
        if not DENOISER_TARGETS & set(self.targets):
            raise ValueError(
                f"compile.backend cudagraphs records the denoiser, and compile.targets {list(self.targets)} "
                "names none (unet or transformer)"
            )
        return self

    @property
    def denoiser(self) -> bool:
        """Whether the denoiser is compiled."""
        return self.enabled and bool(DENOISER_TARGETS & set(self.targets))

    @property
    def decoder(self) -> bool:
        """Whether the VAE's decode is compiled (by inductor: the cudagraphs backend leaves it eager)."""
        return self.enabled and self.backend == "inductor" and "vae_decoder" in self.targets

    def cuda_graphs(self, device_type: str) -> bool:
        """Whether the compiled denoiser replays CUDA graphs on this device."""
        recorded = self.backend == "cudagraphs" or self.mode in ("reduce-overhead", "max-autotune")
        return self.denoiser and recorded and device_type == "cuda"

    def row_counts(self, device_type: str, guided: bool = False) -> tuple[int, ...]:
        """The row counts forwards are padded to on this device (none: unpadded). Where the model's
        defaults are ``guided``, warm-up steps two rows an image, so a compiled denoiser pads one row
        to the least count above it (2 where none is): dynamo compiles a size of 1 apart."""
        pad = self.pad_rows == "on" or self.pad_rows == "auto" and self.cuda_graphs(device_type)
        counts = tuple(sorted(set(self.graph_rows))) if pad else ()
        if not guided or not self.denoiser:
            return counts
        return tuple(count for count in counts if count > 1) or (2,)

    @field_validator("cache_dir")
    @classmethod
    def _cache_dir_is_absolute(cls, value: str | None) -> str | None:
        return absolute_dir(
            value,
            "compile.cache_dir",
            "a worker runs in the archive's temporary unpack directory, which does not survive a restart",
        )


class StepCache(_Section):
    """A request's step cache (its ``cache`` field), and the server's default; per request, so cached
    and uncached requests share each forward.

    - deep: DeepCache (Ma et al., 2023) runs the whole UNet every ``interval`` steps and, at the
      steps between, only its shallow branch, reusing the deep blocks' outputs from the last full step;
    - first_block: First Block Cache runs the first transformer block at every step and skips the
      others where its residual changed by at most ``threshold`` (relative mean absolute change)
      since the last full step, reusing their residual from it.
    """

    mode: Literal["off", "deep", "first_block"] = Field(
        "off",
        description="deep: DeepCache (SD 1.x/2.x and SDXL); first_block: First Block Cache (SD 3.x); off: every "
        "step runs the whole denoiser",
    )
    interval: int = Field(3, ge=1, description="deep: steps from one full UNet forward to the next (1: every step)")
    branch: int = Field(
        0, ge=0, description="deep: the skip branch that runs at the cached steps, 3 per down block (0: the shallowest)"
    )
    threshold: float = Field(
        0.1,
        ge=0,
        allow_inf_nan=False,
        description="first_block: the largest relative change of the first block's residual that skips the "
        "other blocks (0: none is skipped)",
    )

    @model_serializer(mode="wrap")
    def _fields_of_its_mode(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Its mode's settings only (what a response reports back)."""
        fields = handler(self)
        kept = {"off": ("mode",), "deep": ("mode", "interval", "branch"), "first_block": ("mode", "threshold")}
        return {name: value for name, value in fields.items() if name in kept[self.mode]}


class CacheSettings(_Section):
    """Step caching: the default of a request that sends no ``cache``, and the limits of one that does."""

    default: StepCache = Field(
        StepCache(), description="the cache of a request without one (off where the model serves no such cache)"
    )
    max_interval: int = Field(10, ge=1, description="deep: the longest interval a request may ask for")
    max_threshold: float = Field(
        0.5, ge=0, allow_inf_nan=False, description="first_block: the largest threshold a request may ask for"
    )
    max_kept_mib: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="the most memory the caches of the requests in flight keep together (MiB); none: a quarter "
        "of the device's memory on CUDA, no bound on the CPU",
    )

    @model_validator(mode="after")
    def _default_within_limits(self) -> CacheSettings:
        default = self.default
        if default.mode == "deep" and default.interval > self.max_interval:
            raise ValueError(
                f"cache.default.interval {default.interval} is above cache.max_interval {self.max_interval}"
            )
        if default.mode == "first_block" and default.threshold > self.max_threshold:
            raise ValueError(
                f"cache.default.threshold {default.threshold} is above cache.max_threshold {self.max_threshold}"
            )
        return self


class WarmupShape(_Section):
    """One shape generated at worker start so the first user request pays no compilation."""

    width: int = Field(ge=8, multiple_of=8)
    height: int = Field(ge=8, multiple_of=8)
    batch_size: int = Field(1, ge=1, description="images in the warm-up pipeline call")
    num_inference_steps: int = Field(2, ge=1)


class MetricsSettings(_Section):
    """What the handler's metrics are measured against."""

    latency_sla_seconds: float = Field(10.0, gt=0, description="request latency SLA, published as a gauge")


class ProfilerSettings(_Section):
    """``torch.profiler`` over a window of the worker's served steps (``handler.engine.profiling``)."""

    steps: int = Field(0, ge=0, le=1000, description="denoiser forwards to profile, once per worker; 0: off")
    min_rows: int = Field(
        1, ge=1, description="the window opens at the first forward of at least this many rows (under load)"
    )
    dir: str | None = Field(
        None,
        description="absolute directory the summary is written to as step-profile-<pid>.json; None: the log only",
    )

    @field_validator("dir")
    @classmethod
    def _dir_is_absolute(cls, value: str | None) -> str | None:
        return absolute_dir(value, "profiler.dir", "a worker runs in the archive's temporary unpack directory")


class FaultInjection(_Section):
    """For tests on machines without an accelerator: make failure paths reachable. Off by default."""

    out_of_memory_above_pixels: int | None = Field(
        None, ge=1, description="raise out-of-memory for a denoising step whose images x width x height exceed this"
    )
    vae_out_of_memory_above_pixels: int | None = Field(
        None,
        ge=1,
        description="raise out-of-memory for an untiled VAE decode whose images x width x height exceed this",
    )
    postprocess_out_of_memory_above_pixels: int | None = Field(
        None,
        ge=1,
        description="raise out-of-memory for a decode's postprocess (safety checker, watermark, PIL images) whose "
        "images x width x height exceed this",
    )


def continuous_batching(model_yaml_config: dict[str, Any] | None) -> bool:
    """Whether model-config.yaml turns on TorchServe's continuous batching. Refused (ValueError)
    with more than one worker: in TorchServe 0.12 an idle worker waits for work while holding the
    model's lock (``Model.pollInferJob``), so another worker's request in flight cannot take its next
    step until a new request arrives."""
    config = model_yaml_config or {}
    if not config.get("continuousBatching"):
        return False
    workers = max(int(config.get("minWorkers", 1)), int(config.get("maxWorkers", 1)))
    if workers > 1:
        raise ValueError(
            f"continuousBatching: true with {workers} workers: TorchServe 0.12 serves continuous batching correctly "
            "with one worker per model only (an idle worker holds the model's lock while it waits, stalling the other "
            "workers' requests in flight); set minWorkers and maxWorkers to 1, or use dynamic batching"
        )
    return True


class HandlerSettings(_Section):
    """Everything the handler reads from ``model-config.yaml`` under ``handler:``."""

    model_path: str = Field(
        "model",
        description="diffusers directory or single-file .safetensors checkpoint (or a directory holding one), "
        "relative to the archive or absolute",
    )
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = "auto"
    attention: Literal["sdpa", "vanilla"] = "sdpa"
    channels_last: bool = False
    tf32: bool = True
    attention_slicing: bool = False
    vae_slicing: bool = False
    vae_tiling: bool = False
    cpu_offload: Literal["none", "model", "sequential"] = "none"
    checkpoint: CheckpointSettings = CheckpointSettings()
    vae: VaeSettings = VaeSettings()
    compile: CompileSettings = CompileSettings()
    cache: CacheSettings = CacheSettings()
    loras: LoraSettings = LoraSettings()
    controlnets: ControlNetSettings = ControlNetSettings()
    embeddings: EmbeddingSettings = EmbeddingSettings()
    safety_checker: bool = Field(
        True, description="run the model's safety checker where the model directory ships one (SD 1.x); false: off"
    )
    warmup: tuple[WarmupShape, ...] = ()
    text_encoder_3: bool = Field(
        True,
        description="SD 3.x: load the T5 text encoder; false serves without it as diffusers' text_encoder_3=None does "
        "(zero T5 embeddings: 9.5 GB less for T5-XXL in float16, weaker prompt following); other families ignore it",
    )
    max_sequence_length: int = Field(
        256, ge=1, le=512, description="SD 3.x: T5 tokens a prompt is padded or truncated to (diffusers' default 256)"
    )
    max_images_per_call: int = Field(16, ge=1, description="most images one denoiser forward steps")
    step_time_cap: bool = Field(
        True,
        description="cap a forward at the smallest batch within 5% of the best measured step time per image (less "
        "latency where a larger batch gains nothing); false: forwards take up to max_images_per_call (memory "
        "permitting)",
    )
    iteration_budget_ms: float = Field(
        100.0,
        ge=0,
        description="continuous batching: keep stepping within one TorchServe call until this many "
        "milliseconds have passed (at least one step, and never past a finished request), so TorchServe's per-call "
        "cost is shared by several short steps; new requests join between calls. 0: one step per call",
    )
    encode_threads: int = Field(
        4,
        ge=1,
        le=64,
        description="threads that encode finished requests' images (PNG, JPEG, WebP, base64) side by side; on a GPU "
        "they also make the images from the queued decode (safety checker or watermark, PIL images), the next "
        "denoiser forward runs meanwhile, and the answers are collected after it is queued",
    )
    decode_stream: Literal["step", "own"] = Field(
        "step",
        description="on CUDA, where the VAE decode of finished jobs runs: 'step', on the step's stream between the "
        "forward that finished them and the next one (which waits for it); 'own', on a stream of its own beside "
        "the next forward, whose memory pool it does not share (the decode's working memory is held beside the "
        "forward's: where both do not fit, the allocator frees its cache and waits for the device). No effect on "
        "a CPU; 'step' until a GPU measures 'own'",
    )
    request_timeout_s: float | None = Field(
        None,
        gt=0,
        description="most seconds a request may spend in the worker from admission: a request that would pass it "
        "is cancelled before its next step (sd_cancelled_requests_total{reason=deadline}; 504, or a JSON error body "
        "after a continuous-batching answer's 200 left). Below responseTimeout: TorchServe kills a worker whose "
        f"call runs longer. None: {REQUEST_TIMEOUT_SHARE:.0%} of model-config.yaml's responseTimeout, or of "
        f"TorchServe's {TORCHSERVE_RESPONSE_TIMEOUT} s where it sets none (config.properties' default_response_timeout "
        "does not reach the worker)",
    )
    metrics: MetricsSettings = MetricsSettings()
    profiler: ProfilerSettings = ProfilerSettings()
    log_prompts: bool = Field(False, description="log each request's parameters, prompt included, at INFO")
    fault_injection: FaultInjection = FaultInjection()
    defaults: RequestDefaults = RequestDefaults()
    limits: RequestLimits = RequestLimits()

    @model_validator(mode="after")
    def _defaults_within_limits(self) -> HandlerSettings:
        limits, defaults = self.limits, self.defaults
        sides = {"width": defaults.width, "height": defaults.height}
        checks = {
            "num_inference_steps": defaults.num_inference_steps <= limits.max_inference_steps,
            "guidance_scale": defaults.guidance_scale <= limits.max_guidance_scale,
            # the scale a request given the default blocks takes unless it sends its own: diffusers'
            f"skip_guidance_layers' skip_layer_guidance_scale {SkipLayerGuidance.scale}": (
                not defaults.skip_guidance_layers or SkipLayerGuidance.scale <= limits.max_guidance_scale
            ),
            "num_images_per_prompt": defaults.num_images_per_prompt <= limits.max_images_per_request,
            "max_images_per_call": limits.max_images_per_request <= self.max_images_per_call,
            **{name: side is None or limits.min_side <= side <= limits.max_side for name, side in sides.items()},
            "width x height": defaults.width is None
            or defaults.height is None
            or defaults.width * defaults.height <= limits.max_pixels,
        }
        broken = [name for name, ok in checks.items() if not ok]
        if broken:
            raise ValueError(
                "defaults outside the configured limits (or max_images_per_call below max_images_per_request): "
                + ", ".join(broken)
            )
        return self

    @model_validator(mode="after")
    def _cuda_graphs_keep_the_weights_in_place(self) -> HandlerSettings:
        if self.cpu_offload != "none" and self.compile.cuda_graphs("cuda"):
            raise ValueError(
                f"cpu_offload {self.cpu_offload} moves the denoiser's weights off the GPU between its forwards, "
                "and a CUDA graph reads them where it recorded them (it would record again each time): "
                "compile.backend cudagraphs and inductor's modes reduce-overhead and max-autotune need "
                "cpu_offload none"
            )
        return self

    @classmethod
    def from_model_yaml(cls, model_yaml_config: dict[str, Any] | None) -> HandlerSettings:
        """Build settings from TorchServe's parsed ``model-config.yaml`` (``context.model_yaml_config``),
        ``request_timeout_s`` defaulting to its share of the model's ``responseTimeout``."""
        config = model_yaml_config or {}
        handler = dict(config.get("handler") or {})
        response_timeout = float(config.get("responseTimeout", TORCHSERVE_RESPONSE_TIMEOUT))
        if handler.get("request_timeout_s") is None:
            handler["request_timeout_s"] = REQUEST_TIMEOUT_SHARE * response_timeout
        settings = cls.model_validate(handler)
        if settings.request_timeout_s is not None and settings.request_timeout_s >= response_timeout:
            raise ValueError(
                f"handler.request_timeout_s {settings.request_timeout_s:g} must be below responseTimeout "
                f"{response_timeout:g}: TorchServe kills a worker whose call runs past responseTimeout, and a dynamic "
                "batch (or a continuous-batching call holding a full batch or a gRPC request) lasts up to "
                "request_timeout_s"
            )
        return settings

    def for_model(self, width: int, height: int, rules: FamilyRules = FamilyRules()) -> HandlerSettings:
        """These settings for a loaded model: its native size as the default for an unset
        width/height, and the model's own scheduler where the configured default is one its family
        does not serve; checked against the limits again. Raises ValueError for a configured default
        or warm-up size off the family's grid or larger than the model takes, a default
        ``guidance_rescale`` its family's pipelines do not take, default ``skip_guidance_layers``
        its denoiser does not have, or a default ``clip_skip`` beyond its text encoders."""
        defaults = self.defaults.model_dump()
        defaults["width"] = defaults["width"] or width
        defaults["height"] = defaults["height"] or height
        defaults["scheduler"] = rules.default_scheduler(self.defaults.scheduler)
        sizes = {"defaults": (defaults["width"], defaults["height"])}
        sizes |= {f"warmup[{index}]": (shape.width, shape.height) for index, shape in enumerate(self.warmup)}
        for setting, size in sizes.items():
            if any(side % rules.grid or side > (rules.max_side or side) for side in size):
                raise ValueError(
                    f"{setting}: width and height must be multiples of {rules.grid}"
                    + (f" and at most {rules.max_side}" if rules.max_side else "")
                    + f" for this {rules.family} model (got {size[0]}x{size[1]})"
                )
        if self.defaults.guidance_rescale and not rules.guidance_rescale:
            raise ValueError(
                f"defaults.guidance_rescale {self.defaults.guidance_rescale:g}: {rules.family} pipelines have no "
                "guidance_rescale (set it to 0)"
            )
        layers = self.defaults.skip_guidance_layers
        if layers and not rules.transformer_blocks:
            raise ValueError(
                f"defaults.skip_guidance_layers {layers}: {rules.family} models have no skip-layer guidance "
                "(SD 3.x's; leave it unset)"
            )
        problem = rules.skip_layers_problem(layers) if layers else None
        if problem:
            _, template, values = problem
            raise ValueError(f"defaults.{template.format(**values)}")
        if (self.defaults.clip_skip or 0) > rules.max_clip_skip:
            raise ValueError(
                f"defaults.clip_skip {self.defaults.clip_skip} is more than this {rules.family} model's CLIP text "
                f"encoders can skip, keeping one of their layers: at most {rules.max_clip_skip}"
            )
        return type(self).model_validate({**self.model_dump(), "defaults": defaults})

    def warmup_shapes(self) -> tuple[WarmupShape, ...]:
        """The configured warm-up shapes; none configured: the default size (resolved by
        ``for_model``), one image."""
        if self.warmup:
            return self.warmup
        if self.defaults.width is None or self.defaults.height is None:
            raise ValueError("the default size is unresolved; call for_model first")
        return (WarmupShape(width=self.defaults.width, height=self.defaults.height),)

    def resolve_model_path(self, model_dir: str | Path) -> Path:
        """The pipeline directory: ``model_path`` taken relative to the unpacked archive."""
        return Path(model_dir) / self.model_path
