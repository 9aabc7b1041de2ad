"""The family contract: what differs between Stable Diffusion generations, behind one interface.

The step engine (``handler.engine.step_engine``) runs one denoising loop for every family and asks its family
for everything that differs between their diffusers pipelines:

- text conditioning (``encode``): the texts of jobs started together through the family's text
  encoder(s) in one call, then each job's rows ([negative; positive] with guidance);
- the schedule (``scheduler``, ``prepare_scheduler``, ``step_kwargs``): a fresh scheduler per job,
  copied from one built per (scheduler, steps or custom schedule, and where the schedule depends on
  it, the shape);
- the noise arithmetic (``initial_latents``, ``model_input``, ``add_noise``): the UNet schedulers'
  ``init_noise_sigma``, ``scale_model_input`` and ``add_noise`` against flow matching's plain noise
  and ``scale_noise``;
- the denoiser forward (``forward``): one call of the UNet or transformer over the rows of several
  jobs, each row at its own timestep with its own conditioning and ControlNet residuals
  (``control_forward``, ``controlnet_refusal``, ``control_input``, ``control_slots``);
- the VAE (``encode_image``, ``vae_decode``) and post-processing (``postprocess``: safety checker,
  watermark);
- the request rules (``rules``): schedulers, the size grid, how an input image's steps round.

A family is a subclass in a module of its own, detected from the loaded pipeline's exact class
(``handler.families.family_of``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, ClassVar, Literal, Protocol, TypeGuard

import torch
from diffusers import (
    FlowMatchEulerDiscreteScheduler,
    KDPM2AncestralDiscreteScheduler,
    KDPM2DiscreteScheduler,
    LMSDiscreteScheduler,
)
from diffusers.image_processor import VaeImageProcessor
from PIL.Image import Image

from handler.config import CUSTOM_SCHEDULE_FIELDS, FamilyRules, SchedulerName, SizeConditioning
from handler.families.transfer import to_device

# Scheduler templates a family keeps: one per (scheduler, steps, timestep options, custom schedule) in
# use, such as SD 3's ``mu`` per image size.
TEMPLATES_KEPT = 64
# What diffusers' set_timesteps (0.42.1) leaves on the device it is given: the timesteps, flow
# matching's sigmas too, and DPM2's interpolated sigmas and log-sigmas (DPM2 ancestral's up and down
# sigmas as well), where Euler, Euler ancestral, Heun, DPM2, DPM++ and UniPC copy their sigmas back to
# the host. A scheduler a family offers is checked against diffusers' placement by
# tests/unit/test_host_reads.py.
ON_DEVICE: dict[type, tuple[str, ...]] = {
    FlowMatchEulerDiscreteScheduler: ("timesteps", "sigmas"),
    KDPM2DiscreteScheduler: ("timesteps", "sigmas_interpol", "log_sigmas"),
    KDPM2AncestralDiscreteScheduler: ("timesteps", "sigmas_interpol", "sigmas_up", "sigmas_down", "log_sigmas"),
}
# The order of LMS's linear multistep method: LMSDiscreteScheduler.step's default, which pipelines keep.
LMS_ORDER = 4
# A custom schedule a scheduler's set_timesteps is tried with, to learn whether it takes one: timesteps
# every UNet schedule has, sigmas within Euler's and flow matching's ranges.
PROBES: dict[str, list[float]] = {"timesteps": [1, 0], "sigmas": [1.0, 0.5]}

# A loaded diffusers pipeline of one of the families. diffusers registers a pipeline's components
# (unet, transformer, vae, scheduler, ...) at run time, so its classes declare none of them to a type checker.
Pipeline = Any
# ControlNet residuals for a denoiser forward, each over all its rows: one tensor per place the
# denoiser adds one (a UNet: each down-block output, then its mid block's; an SD 3.x transformer: each
# block's output, several places sharing one tensor where a ControlNet has fewer blocks).
Residuals = list[torch.Tensor]
# A diffusers scheduler class (its from_config is added at run time) and the settings it needs on top
# of the model's scheduler config.
SchedulerChoice = tuple[Any, dict[str, Any]]
# A text a job's rows encode: what each text encoder reads (``prompt``, ``prompt_2``, ``prompt_3``),
# with the CLIP layers it skips (``clip_skip``; None: the family's default).
Text = tuple[tuple[str, ...], int | None]


class Scheduler(Protocol):
    """What the engine uses of a diffusers scheduler (they share no typed base class); the noise
    arithmetic, which differs, is the family's."""

    timesteps: torch.Tensor
    order: int

    def set_timesteps(
        self, num_inference_steps: int | None = None, device: torch.device | None = None, **kwargs: Any
    ) -> None: ...

    def step(
        self, model_output: torch.Tensor, timestep: torch.Tensor | int, sample: torch.Tensor, **kwargs: Any
    ) -> Any: ...


class IndexedScheduler(Scheduler, Protocol):
    """A scheduler that steps by index from a begin index (Euler, Euler ancestral, LMS, Heun, DPM2,
    DPM++, UniPC, flow matching), not by looking its step up by timestep value (DDIM, PNDM)."""

    sigmas: torch.Tensor

    @property
    def step_index(self) -> int | None: ...

    @property
    def begin_index(self) -> int | None: ...

    def set_begin_index(self, begin_index: int = 0) -> None: ...


def steps_by_index(scheduler: Any) -> TypeGuard[IndexedScheduler]:
    """Whether ``scheduler`` is an ``IndexedScheduler``."""
    return hasattr(scheduler, "set_begin_index")


def set_timesteps_on_host(
    scheduler: Scheduler, steps: int | None, device: torch.device, options: dict[str, Any]
) -> list[float]:
    """``scheduler.set_timesteps(steps, device=device, **options)`` without waiting for the device
    (``steps`` None: a custom schedule's ``timesteps`` or ``sigmas`` in ``options`` give them, as
    diffusers' ``retrieve_timesteps`` calls it); returns the timesteps' host copy. The schedulers
    here compute their schedule on the host and copy it to the device (flow matching also computes
    ``1 - sigma`` and ``sigma * N`` there, correctly rounded float32 arithmetic: the same bits on the
    host), and some copy their sigmas back, a wait each, as is reading the timesteps back. Here it is
    made on the host and what diffusers leaves on the device (``ON_DEVICE``) is queued there
    (``to_device``). Two schedules may differ: Euler with continuous timesteps (v-prediction EDM
    configs) takes their logarithm on the device in diffusers, here on the host, and DPM2 (plain and
    ancestral) interpolates its sigmas there (``log``, ``lerp``, ``exp``) and its half-step timesteps
    from them: the last float32 bit may differ."""
    steps_given = {} if steps is None else {"num_inference_steps": steps}
    scheduler.set_timesteps(**steps_given, device=torch.device("cpu"), **options)
    host = scheduler.timesteps.tolist()
    for name in ON_DEVICE.get(type(scheduler), ("timesteps",)):
        setattr(scheduler, name, to_device(getattr(scheduler, name), device))
    return host


class LmsCoefficients:
    """An LMS schedule's linear multistep coefficients per step, newest derivative first, as
    ``LMSDiscreteScheduler.step`` integrates them at that step: each step's integrated at its first
    use and shared by the schedule template's copies, with diffusers' own ``get_lms_coefficient`` over
    a float32 NumPy copy of the sigmas (the same arithmetic as over its tensors, bit for bit, and
    faster: docs/benchmarks.md)."""

    def __init__(self, template: Any) -> None:
        self._host = SimpleNamespace(sigmas=template.sigmas.numpy().copy())  # all get_lms_coefficient reads
        self._steps: dict[int, list[float]] = {}

    def __getitem__(self, index: int) -> list[float]:
        if index not in self._steps:
            order = min(index + 1, LMS_ORDER)
            integrate = LMSDiscreteScheduler.get_lms_coefficient
            self._steps[index] = [integrate(self._host, order, index, k) for k in range(order)]
        return self._steps[index]

    @property
    def integrated(self) -> int:
        """How many steps' coefficients are integrated so far."""
        return len(self._steps)

    def __deepcopy__(self, memo: dict[int, Any]) -> LmsCoefficients:
        return self  # shared by the template's copies


class PromptSpec(Protocol):
    """What a family conditions a job on (``handler.engine.step_engine.JobSpec`` is one)."""

    @property
    def prompt(self) -> str: ...

    @property
    def negative_prompt(self) -> str | None: ...

    @property
    def clip_skip(self) -> int | None: ...

    @property
    def prompt_2(self) -> str | None: ...

    @property
    def negative_prompt_2(self) -> str | None: ...

    @property
    def prompt_3(self) -> str | None: ...

    @property
    def negative_prompt_3(self) -> str | None: ...

    @property
    def size_conditioning(self) -> SizeConditioning | None: ...

    @property
    def image(self) -> Image | None: ...

    @property
    def width(self) -> int: ...

    @property
    def height(self) -> int: ...

    @property
    def images(self) -> int: ...

    @property
    def guided(self) -> bool: ...


class UnsupportedPipeline(ValueError):
    """The model directory holds a pipeline the engine does not serve."""


@dataclass(frozen=True)
class Conditioning:
    """What the denoiser needs for one job's rows besides latents and timesteps: text embeddings
    ([negative; positive] with guidance) and the family's other conditioning per row, by name
    (SDXL's ``text_embeds`` and ``time_ids``, SD 3.x's ``pooled_projections``)."""

    hidden_states: torch.Tensor
    added: dict[str, torch.Tensor] = field(default_factory=dict)

    @staticmethod
    def concat(items: Sequence[Conditioning]) -> Conditioning:
        """The rows of several jobs for one forward."""
        hidden = torch.cat([item.hidden_states for item in items])
        return Conditioning(hidden, {name: torch.cat([item.added[name] for item in items]) for name in items[0].added})

    def rows(self, index: slice | torch.Tensor) -> Conditioning:
        """Some of these rows (a slice, or row numbers)."""
        return Conditioning(self.hidden_states[index], {name: value[index] for name, value in self.added.items()})

    def padded(self, padding: int) -> Conditioning:
        """These rows and ``padding`` copies of the last (rows that pad a forward to a captured count)."""
        if not padding:
            return self
        added = {name: padded_rows(value, padding) for name, value in self.added.items()}
        return Conditioning(padded_rows(self.hidden_states, padding), added)


# The LoRA rows of a sub-batch of a forward's jobs (by index), for the step
# caches whose blocks run on some rows only.
SubBatchRows = Callable[[list[int]], AbstractContextManager[Any]]

# How a step cache compiles the regions of a compiled denoiser (``torch.compile`` with the
# configured options): the blocks its wrappers call, each compiled apart, while a forward with cached
# rows runs the Python between them (which rows run which block) eagerly.
RegionCompiler = Callable[[Callable[..., Any]], Callable[..., Any]]


def mark_rows(rows: int, tensors: Iterable[Any]) -> None:
    """Mark dim 0 of the tensors among ``tensors`` that have ``rows`` rows dynamic, so that dynamo
    compiles a compiled denoiser's (or region's) first call of two rows or more for every such
    count at once. Unmarked, it compiles that count alone, then every count again at the next one
    (torch's automatic dynamic shapes): a second compile per graph kind, at warm-up or while
    serving. One row stays a graph apart (dynamo specializes a size of 1)."""
    if rows < 2:
        return
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.dim() and tensor.shape[0] == rows:
            torch._dynamo.maybe_mark_dynamic(tensor, 0)


def rows_marked(region: Callable[..., Any]) -> Callable[..., Any]:
    """``region`` (a compiled block, or the VAE's decode: its rows lead its first tensor argument)
    with its tensor arguments' rows marked dynamic at each call (``mark_rows``)."""

    @functools.wraps(region)
    def marked(*args: Any, **kwargs: Any) -> Any:
        arguments = [*args, *kwargs.values()]
        first = next((value for value in arguments if isinstance(value, torch.Tensor) and value.dim()), None)
        if first is not None:
            mark_rows(first.shape[0], arguments)
        return region(*args, **kwargs)

    return marked


@contextlib.contextmanager
def eager_call(module: torch.nn.Module) -> Iterator[None]:
    """Within it, a module compiled in place (``nn.Module.compile``) runs its eager ``__call__``:
    a step cache's forward, whose per-row decisions a whole-model graph would guard on and
    recompile for, runs around its compiled regions instead."""
    compiled = module._compiled_call_impl
    module._compiled_call_impl = None
    try:
        yield
    finally:
        module._compiled_call_impl = compiled


class RowBlocks:
    """A forward's rows as consecutive blocks, one per job (``counts``), and the rows of some of them:
    what a step cache's sub-batch takes."""

    def __init__(self, counts: Sequence[int]):
        stops = list(itertools.accumulate(counts))
        self.spans = [slice(stop - count, stop) for count, stop in zip(counts, stops, strict=True)]
        self.rows = stops[-1] if stops else 0

    def taken(self, tensor: torch.Tensor, blocks: Sequence[int]) -> torch.Tensor:
        """The rows of ``blocks`` (ascending): a view where they are consecutive, else a copy."""
        spans = [self.spans[block] for block in blocks]
        if all(before.stop == after.start for before, after in itertools.pairwise(spans)):
            return tensor[spans[0].start : spans[-1].stop]
        return torch.cat([tensor[span] for span in spans])


def padded_rows(rows: torch.Tensor, padding: int) -> torch.Tensor:
    """``rows`` and ``padding`` copies of its last row."""
    return torch.cat([rows, rows[-1:].expand(padding, *rows.shape[1:])]) if padding else rows


@dataclass(frozen=True)
class TextEmbedding:
    """Text through the family's text encoder(s): ``(rows, tokens, width)`` hidden states and,
    where the family pools, ``(rows, width)`` pooled embeddings."""

    hidden_states: torch.Tensor
    pooled: torch.Tensor | None = None

    def zeros(self) -> TextEmbedding:
        """SDXL's unconditional embedding for an absent negative prompt (``force_zeros_for_empty_prompt``)."""
        return TextEmbedding(
            torch.zeros_like(self.hidden_states), None if self.pooled is None else torch.zeros_like(self.pooled)
        )

    def repeat(self, times: int) -> TextEmbedding:
        """Each row ``times`` times (``num_images_per_prompt``)."""
        return TextEmbedding(
            self.hidden_states.repeat(times, 1, 1), None if self.pooled is None else self.pooled.repeat(times, 1)
        )

    @staticmethod
    def concat(items: Sequence[TextEmbedding]) -> TextEmbedding:
        hidden = torch.cat([item.hidden_states for item in items])
        pooled = [item.pooled for item in items if item.pooled is not None]
        return TextEmbedding(hidden, torch.cat(pooled) if pooled else None)


def row_slices(sizes: Sequence[int]) -> list[slice]:
    """The rows of consecutive parts of ``sizes`` rows each."""
    ends = itertools.accumulate(sizes)
    return [slice(end - size, end) for end, size in zip(ends, sizes, strict=True)]


@dataclass(frozen=True)
class Decoded:
    """Images of one decode, and per image whether the safety checker flagged it (None: no
    checker ran, as diffusers reports it)."""

    images: list[Image]
    nsfw_content_detected: list[bool] | None

    def split(self, sizes: list[int]) -> list[Decoded]:
        return [self.rows(rows) for rows in row_slices(sizes)]

    def rows(self, rows: slice) -> Decoded:
        """The images ``rows`` selects, with their flags."""
        flags = None if self.nsfw_content_detected is None else self.nsfw_content_detected[rows]
        return Decoded(self.images[rows], flags)

    @staticmethod
    def join(parts: list[Decoded]) -> Decoded:
        images = [image for part in parts for image in part.images]
        if any(part.nsfw_content_detected is None for part in parts):
            return Decoded(images, None)
        return Decoded(images, [flag for part in parts for flag in part.nsfw_content_detected or []])


class Family(ABC):
    """One family of Stable Diffusion pipelines on the step engine (the contract)."""

    pipeline_class: ClassVar[type]  # the text-to-image pipeline, matched exactly
    denoiser_name: ClassVar[str]  # the pipeline's attribute holding the denoiser
    schedulers: ClassVar[dict[SchedulerName, SchedulerChoice]]  # what a request may name
    strength_rounding: ClassVar[Literal["steps", "start"]] = "steps"  # FamilyRules.strength_rounding
    # The denoiser's own attention processor, kept whatever handler.attention says (None: it takes the
    # configured one, as the UNets do).
    own_attention: ClassVar[type | None] = None
    takes_controlnets: ClassVar[bool] = False  # FamilyRules.controlnets
    controlnet_excludes: ClassVar[tuple[str, ...]] = ()  # FamilyRules.controlnet_excludes
    # Whether the engine adds its ControlNet residuals between the denoiser's blocks (its block
    # wrappers, as a step cache's forward: SD 3.x) instead of passing them to the denoiser's forward.
    controls_in_blocks: ClassVar[bool] = False
    controlnet_class: ClassVar[Any] = None  # the diffusers class of its ControlNet directories
    # Whether a single-file ControlNet is built as its denoiser's (A1111's files: the UNet families').
    controlnet_files: ClassVar[bool] = False
    takes_guidance_rescale: ClassVar[bool] = True  # FamilyRules.guidance_rescale
    takes_size_conditioning: ClassVar[bool] = False  # FamilyRules.size_conditioning
    # Which hidden states of its CLIP encoders a prompt conditions on, counted from the end: 1 the
    # last (then the final layer norm: SD 1.x/2.x), 2 the penultimate (SDXL, SD 3.x); ``clip_skip``
    # k takes ``hidden_states[-(k + clip_layer_from_last)]`` (``encode_prompt``).
    clip_layer_from_last: ClassVar[int] = 1

    def __init__(self, pipeline: Pipeline, device: torch.device, dtype: torch.dtype, max_sequence_length: int = 256):
        self.pipeline = pipeline
        self.device = device
        self.dtype = dtype
        self.max_sequence_length = max_sequence_length  # T5 tokens, where the family has a T5 encoder (SD 3.x)
        # The inpaint pipelines' mask processor: one grey channel, binarized, not normalized.
        self.mask_processor = VaeImageProcessor(
            vae_scale_factor=pipeline.vae_scale_factor, do_normalize=False, do_binarize=True, do_convert_grayscale=True
        )
        # The ControlNet pipelines' control image processor: RGB in [0, 1], not normalized.
        self.control_processor = VaeImageProcessor(
            vae_scale_factor=pipeline.vae_scale_factor, do_convert_rgb=True, do_normalize=False
        )
        # Least recently used first: each with its timesteps' CPU copy.
        self._templates: OrderedDict[tuple, tuple[Scheduler, list[float]]] = OrderedDict()
        self._built: dict[SchedulerName, Any] = {}  # each scheduler as built from the config, never set

    @classmethod
    def refuse(cls, pipeline: Pipeline) -> str | None:
        """Why a pipeline of this class cannot be served after all (None: it can)."""
        return None

    # What the family is.

    @property
    @abstractmethod
    def name(self) -> str: ...

    @property
    def denoiser(self) -> Any:  # a diffusers model (UNet2DConditionModel, SD3Transformer2DModel), or it compiled
        return getattr(self.pipeline, self.denoiser_name)

    @property
    def patch_size(self) -> int:
        """Latent pixels per denoiser token side (1 for a UNet)."""
        return 1

    @functools.cached_property
    def rules(self) -> FamilyRules:
        return FamilyRules(
            self.name,
            tuple(self.schedulers),
            self.own_scheduler,
            self.pipeline.vae_scale_factor * self.patch_size,
            self.strength_rounding,
            self.max_side,
            self.takes_controlnets,
            self.max_steps,
            max_clip_skip=self.max_clip_skip,
            guidance_rescale=self.takes_guidance_rescale,
            text_encoders=self.text_encoders,
            zeros_without_negative=self.zeros_without_negative,
            size_conditioning=self.takes_size_conditioning,
            custom_schedules=self.custom_schedules(),
            train_timesteps=int(self.pipeline.scheduler.config.get("num_train_timesteps", 1000)),
            max_sigma=self._max_sigma(),
            eta_schedulers=self.eta_schedulers(),
            controlnet_excludes=self.controlnet_excludes,
            two_call_schedulers=tuple(name for name, (cls, _) in self.schedulers.items() if cls.order > 1),
        )

    def eta_schedulers(self) -> tuple[SchedulerName, ...]:
        """The schedulers whose step takes ``eta``, where the family's pipeline passes it (none of SD 3's)."""
        if "eta" not in inspect.signature(self.pipeline_class.__call__).parameters:
            return ()
        return tuple(
            name
            for name, (scheduler_class, _) in self.schedulers.items()
            if "eta" in inspect.signature(scheduler_class.step).parameters
        )

    def _max_sigma(self) -> float:
        """The largest sigma of the model's training schedule, as its Euler scheduler has it (1, flow
        matching's, where the family has none)."""
        if "euler" not in self.schedulers:
            return 1.0
        return float(self._new_scheduler("euler").sigmas.max())

    def custom_schedules(self) -> tuple[tuple[SchedulerName, tuple[str, ...]], ...]:
        """What each of its schedulers takes of a custom schedule (``timesteps``, ``sigmas``): what the
        family's pipeline takes and the scheduler's ``set_timesteps`` accepts on the model's scheduler
        config (diffusers refuses custom timesteps beside Karras sigmas, for one), tried once here."""
        called = inspect.signature(self.pipeline_class.__call__).parameters
        taken = [
            (name, tuple(field for field in CUSTOM_SCHEDULE_FIELDS if field in called and self._takes(name, field)))
            for name in self.schedulers
        ]
        return tuple((name, fields) for name, fields in taken if fields)

    def _takes(self, name: SchedulerName, field: str) -> bool:
        """Whether scheduler ``name`` sets a custom schedule's ``field`` (``PROBES``) without refusing it."""
        if field not in inspect.signature(self.schedulers[name][0].set_timesteps).parameters:
            return False
        scheduler = self._new_scheduler(name)
        options = self._timestep_options(self.latent_shape(*self.native_size()))
        try:
            scheduler.set_timesteps(device=torch.device("cpu"), **options, **{field: PROBES[field]})
        except Exception:  # diffusers refuses it (ValueError), or its config's arithmetic cannot take it
            return False
        return True

    @property
    def max_side(self) -> int | None:
        """The largest width or height the denoiser takes (None: any, as a UNet)."""
        return None

    @property
    def max_steps(self) -> int | None:
        """The most denoising steps its schedulers take (None: any)."""
        return None

    @property
    def max_clip_skip(self) -> int:
        """The most layers a prompt's ``clip_skip`` may skip: each CLIP text encoder keeps one of
        its layers (SD 1.x's CLIP ViT-L/14 of 12 layers: 11; SDXL's: 10)."""
        encoders = [getattr(self.pipeline, name, None) for name in ("text_encoder", "text_encoder_2")]
        layers = [encoder.config.num_hidden_layers for encoder in encoders if encoder is not None]
        return max(min(layers, default=0) - self.clip_layer_from_last, 0)

    @property
    def text_encoders(self) -> int:
        """The text encoders a job's prompts address (``prompt``, ``prompt_2``, ``prompt_3``): those
        the model is served with (one here)."""
        return 1

    @property
    def zeros_without_negative(self) -> bool:
        """Whether its unguided rows are zeros where a job has no negative prompt (not here)."""
        return False

    @property
    def own_scheduler(self) -> SchedulerName:
        """The name of the model's own scheduler class, else the family's first."""
        own = type(self.pipeline.scheduler)
        return next((name for name, (cls, _) in self.schedulers.items() if cls is own), next(iter(self.schedulers)))

    def latent_shape(self, width: int, height: int) -> tuple[int, int, int]:
        """Channels, height and width of one image's latents."""
        scale = self.pipeline.vae_scale_factor
        return self.denoiser.config.in_channels, height // scale, width // scale

    def native_size(self) -> tuple[int, int]:
        """The resolution the model was trained at: the denoiser's sample size times the VAE's scale."""
        side = self.denoiser.config.sample_size * self.pipeline.vae_scale_factor
        return side, side

    # Text conditioning: __call__'s encode_prompt.

    def encode(self, specs: Sequence[PromptSpec]) -> list[Conditioning]:
        """``encode_prompt`` for jobs started together: every distinct text they need (their
        prompts, and the negative prompts of guided jobs) through the text encoder(s) in ONE call
        per ``clip_skip`` among them, then each job's rows (``num_images_per_prompt`` of each text,
        [negative; positive] with guidance). Each text is encoded on its own row, padded to the
        tokenizer's length, so a job's rows equal its own ``encode_prompt`` call to float rounding."""
        wanted = list(dict.fromkeys(text for spec in specs for text in self._texts(spec)))
        embedded: dict[Text, TextEmbedding] = {}
        with torch.inference_mode():
            for clip_skip in dict.fromkeys(skip for _, skip in wanted):
                texts = [text for text in wanted if text[1] == clip_skip]
                embedded.update(
                    zip(texts, self._encode_texts([prompts for prompts, _ in texts], clip_skip), strict=True)
                )
            return [self._condition(spec, self._rows(spec, embedded)) for spec in specs]

    def _texts(self, spec: PromptSpec) -> list[Text]:
        """The texts of a job's rows: its prompts with its ``clip_skip``, and with guidance its
        negative texts, which diffusers' ``encode_prompt`` encodes without it."""
        prompt: Text = (self._per_encoder(spec.prompt, spec.prompt_2, spec.prompt_3), spec.clip_skip or None)
        negative = self._negative_texts(spec)  # skipping 0 layers (above) is diffusers' default too
        return [prompt] if not spec.guided or negative is None else [prompt, (negative, None)]

    def _per_encoder(self, text: str, text_2: str | None, text_3: str | None) -> tuple[str, ...]:
        """What each of the text encoders reads: ``text_2`` and ``text_3`` where given, else
        ``text`` (diffusers' ``prompt_2 = prompt_2 or prompt``)."""
        return (text, text_2 or text, text_3 or text)[: self.text_encoders]

    def _negative_texts(self, spec: PromptSpec) -> tuple[str, ...] | None:
        """What a job's unconditional rows encode: its negative prompts, "" without one (as
        ``encode_prompt`` does); None where the family conditions on zeros instead (then whatever
        ``negative_prompt_2`` says, as ``encode_prompt``; a request is refused it)."""
        if spec.negative_prompt is None and self.zeros_without_negative:
            return None
        negative = spec.negative_prompt or ""
        return self._per_encoder(negative, spec.negative_prompt_2, spec.negative_prompt_3)

    @abstractmethod
    def _encode_texts(self, texts: list[tuple[str, ...]], clip_skip: int | None) -> list[TextEmbedding]:
        """Each text on its own row through the text encoder(s) (``texts``: what each encoder
        reads, ``_per_encoder``), the CLIP encoders' hidden states taken ``clip_skip`` layers
        earlier than the family's default (None: the default)."""

    def _rows(self, spec: PromptSpec, embedded: dict[Text, TextEmbedding]) -> TextEmbedding:
        """A job's text rows: each text's repeated per image, [negative; positive] with guidance."""
        prompt, *negative = self._texts(spec)
        positive = embedded[prompt].repeat(spec.images)
        if not spec.guided:
            return positive
        unconditional = embedded[negative[0]] if negative else embedded[prompt].zeros()
        return TextEmbedding.concat([unconditional.repeat(spec.images), positive])

    @abstractmethod
    def _condition(self, spec: PromptSpec, rows: TextEmbedding) -> Conditioning:
        """What the denoiser takes of a job's text rows."""

    # The schedule.

    def scheduler(
        self,
        name: SchedulerName,
        steps: int,
        latent_shape: tuple[int, ...],
        custom: dict[str, list[float]] | None = None,
    ) -> tuple[Scheduler, list[float]]:
        """A fresh scheduler with ``steps`` timesteps (``custom``: from a custom schedule's
        ``timesteps`` or ``sigmas``, which run ``steps``), and a CPU copy of them (what its steps read
        on the host, ``handler.families.schedules``): a copy of one built and set once per (scheduler,
        steps, timestep options, custom schedule), which costs a fifth of building it from the
        model's config, and set without waiting for the device (``set_timesteps_on_host``). At most
        ``TEMPLATES_KEPT`` templates are kept, the least recently used dropped."""
        options, custom = self._timestep_options(latent_shape), custom or {}
        schedule = tuple((field, tuple(values)) for field, values in custom.items())
        key = (name, steps, tuple(sorted(options.items())), schedule)
        if key not in self._templates:
            template = self._new_scheduler(name)
            host = set_timesteps_on_host(template, None if custom else steps, self.device, {**options, **custom})
            if isinstance(template, LMSDiscreteScheduler):
                template.lms_coefficients = LmsCoefficients(template)  # type: ignore[attr-defined]  # shared by its copies
            calls = 1 + (steps - 1) * template.order  # Heun's and DPM2's steps are two calls but the first
            if custom and len(host) != calls:
                raise ValueError(f"{name}'s schedule from {custom} runs {len(host)} calls, not the job's {calls}")
            self._templates[key] = (template, host)
            if len(self._templates) > TEMPLATES_KEPT:
                self._templates.popitem(last=False)
        self._templates.move_to_end(key)
        template, host = self._templates[key]
        return copy.deepcopy(template), host

    def _new_scheduler(self, name: SchedulerName) -> Any:
        """Scheduler ``name`` as built from the model's scheduler config with the settings it needs on
        top: a copy of the one built once (DPM2's constructor sets a 1000-step schedule, half a second
        on the host; a copy takes milliseconds)."""
        if name not in self._built:
            scheduler_class, overrides = self.schedulers[name]
            self._built[name] = scheduler_class.from_config(self.pipeline.scheduler.config, **overrides)
        return copy.deepcopy(self._built[name])

    def _timestep_options(self, latent_shape: tuple[int, ...]) -> dict[str, float]:
        """What ``set_timesteps`` takes besides the steps (none: the schedule is the same at every size)."""
        return {}

    def prepare_scheduler(self, scheduler: Scheduler) -> None:
        """A text-to-image job's scheduler starts at step 0 by index where it takes a begin index (as
        SDXL's pipeline sets it; the others' look the first step up by timestep value, which reads
        the timestep on the host: no schedule here repeats one, so it is the same step)."""
        if steps_by_index(scheduler):
            scheduler.set_begin_index(0)

    def step_kwargs(self, scheduler: Scheduler, generators: list[torch.Generator], eta: float) -> dict[str, Any]:
        """``prepare_extra_step_kwargs``: what ``scheduler.step`` takes of ``eta`` and generator."""
        parameters = inspect.signature(scheduler.step).parameters
        kwargs: dict[str, Any] = {}
        if "eta" in parameters:
            kwargs["eta"] = eta
        if "generator" in parameters:
            kwargs["generator"] = generators
        return kwargs

    # The noise arithmetic.

    @abstractmethod
    def initial_latents(self, scheduler: Scheduler, noise: torch.Tensor) -> torch.Tensor:
        """Pure noise as the first latents (``prepare_latents``)."""

    @abstractmethod
    def model_input(self, scheduler: Scheduler, rows: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        """The denoiser's input rows at ``timestep``."""

    @abstractmethod
    def add_noise(
        self, scheduler: Scheduler, original: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor:
        """Image latents noised to ``timesteps`` (image-to-image's start, inpainting's kept area)."""

    # The denoiser.

    @abstractmethod
    def forward(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        conditioning: Conditioning,
        residuals: Residuals | None = None,
    ) -> torch.Tensor:
        """One denoiser call over rows, each at its own timestep: the noise (or velocity) prediction;
        ``residuals``: ControlNet residuals for every row (families that take them in the forward,
        not ``controls_in_blocks``)."""

    # ControlNets (``handler.adapters.controlnets``).

    def controlnet_refusal(self, config: Any) -> str | None:
        """Why a ControlNet with this config cannot serve this model (None: it can)."""
        return f"{self.name} models take no ControlNets"

    def prepare_controlnet(self, net: Any) -> Any:
        """A loaded ControlNet made ready for this model's denoiser (itself, unless the family says)."""
        return net

    def control_forward(
        self, net: Any, latents: torch.Tensor, timesteps: torch.Tensor, conditioning: Conditioning, images: torch.Tensor
    ) -> Residuals:
        """One ControlNet call over rows (scale 1): its residuals, in its own order (``control_slots``)."""
        raise NotImplementedError(f"{self.name} models take no ControlNets")

    def control_residuals(self, net: Any) -> int:
        """How many residuals a ControlNet gives: one per down-block output and the mid block's."""
        return len(net.controlnet_down_blocks) + 1

    def control_slots(self, residuals: Sequence[int]) -> tuple[int, ...]:
        """Which residual of each of a job's ControlNets (giving ``residuals`` each) each place of
        the denoiser's forward adds, in ``Residuals`` order: here each its own."""
        return tuple(range(residuals[0]))

    def control_zeros(self, latents: torch.Tensor, dtype: torch.dtype) -> Residuals:
        """Residuals that add nothing to any row of a forward over ``latents``: what a compiled
        denoiser serving ControlNets takes in every forward, so one graph serves forwards with and
        without them."""
        raise NotImplementedError(f"{self.name} models take no ControlNets in a compiled forward")

    def control_input(
        self, net: Any, image: Image, width: int, height: int, rows: int, generator: torch.Generator
    ) -> torch.Tensor:
        """What a ControlNet reads of a job's control image, one per row or one for all of them:
        here ``(1, 3, height, width)`` in [0, 1] as the ControlNet pipelines' ``prepare_image`` makes
        it, resized by their control image processor where its size differs."""
        pixels = self.control_processor.preprocess(image, height=height, width=width)
        return pixels.to(device=self.device, dtype=self.dtype)

    def control_placeholder(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """A blank control input for one row of ``latents`` (counting a ControlNet's operations)."""
        return torch.zeros((1, 3, height, width), dtype=latents.dtype, device=latents.device)

    # The VAE and the images.

    def preprocess(self, image: Image, width: int, height: int, dtype: torch.dtype) -> torch.Tensor:
        """An input image as the img2img and inpaint pipelines take it: ``(1, 3, height, width)``
        in [-1, 1] (resized by the pipeline's image processor where its size differs)."""
        pixels = self.pipeline.image_processor.preprocess(image, height=height, width=width)
        return pixels.to(device=self.device, dtype=dtype)

    def preprocess_mask(self, mask: Image, width: int, height: int) -> torch.Tensor:
        """The inpaint pipelines' ``mask_condition``: ``(1, 1, height, width)``, 1 where repainted."""
        return self.mask_processor.preprocess(mask, height=height, width=width).to(self.device)

    @abstractmethod
    def encode_image(self, pixels: torch.Tensor, generators: list[torch.Generator], inpaint: bool) -> torch.Tensor:
        """``prepare_latents`` / ``_encode_vae_image``: image ``i`` through the VAE encoder, its
        latents sampled with ``generators[i]``, scaled as the denoiser takes them."""

    def _vae_encode(self, pixels: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
        vae = self.pipeline.vae
        return torch.cat(
            [
                vae.encode(pixels[index : index + 1]).latent_dist.sample(generator)
                for index, generator in enumerate(generators)
            ]
        )

    @abstractmethod
    def vae_decode(self, latents: torch.Tensor, tiled: bool) -> torch.Tensor:
        """The VAE decode at the end of ``__call__`` (in tiles after running out of memory)."""

    def _decode(self, latents: torch.Tensor, tiled: bool) -> torch.Tensor:
        vae = self.pipeline.vae
        return (vae.tiled_decode if tiled else vae.decode)(latents, return_dict=False)[0]

    def postprocess(self, image: torch.Tensor) -> Decoded:
        """Decoded pixels as PIL images (no safety checker)."""
        return Decoded(self.pipeline.image_processor.postprocess(image, output_type="pil"), None)
