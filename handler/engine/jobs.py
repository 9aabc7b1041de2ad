"""A job of the step engine: what it generates (``JobSpec``) and its state between steps
(``DenoiseJob``: what diffusers' ``__call__`` holds in its locals), with what an inpainting job
puts back after each step (``Inpainting``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from PIL.Image import Image

from handler.adapters.controlnets import Control, ControlSpec
from handler.adapters.loras import Adapters
from handler.config import OTHER_PROMPTS, SchedulerName, SizeConditioning, SkipLayerGuidance, StepCache, guided_at
from handler.families import Conditioning, Family, Scheduler, schedules
from handler.families.deep_cache import RowCache
from handler.families.first_block_cache import FirstBlockCache

# A job's texts, as diffusers' pipelines name them: the prompt and negative prompt, and those of the
# second and third text encoders.
PROMPT_FIELDS = ("prompt", "negative_prompt", *OTHER_PROMPTS)


@dataclass(frozen=True)
class JobSpec:
    """What a job generates: one prompt, ``len(seeds)`` images (image k from its own CPU
    generator seeded ``seeds[k]``), at one size, steps, scheduler and guidance scale."""

    prompt: str
    negative_prompt: str | None
    seeds: tuple[int, ...]
    width: int
    height: int
    num_inference_steps: int
    scheduler: SchedulerName
    guidance_scale: float
    image: Image | None = None  # image-to-image from this picture (resized to width x height)
    mask: Image | None = None  # inpainting: white where the image is repainted (with ``image``)
    strength: float = 1.0  # how much of the schedule an input image goes through
    adapters: Adapters = ()  # LoRA adapters (ids of the engine's library) and scales, active in its forwards
    controls: tuple[ControlSpec, ...] = ()  # ControlNets (ids of the engine's library) with their images
    cache: StepCache | None = None  # its step cache (None: every step runs the whole denoiser)
    clip_skip: int | None = None  # CLIP layers its prompt skips (diffusers' clip_skip; None: none)
    guidance_rescale: float = 0.0  # diffusers' guidance_rescale of its guided noise (0: none)
    # The prompts of the second and third text encoders (SDXL's, SD 3.x's; None: the prompt's or
    # the negative prompt's, as diffusers' ``prompt_2 = prompt_2 or prompt``).
    prompt_2: str | None = None
    negative_prompt_2: str | None = None
    prompt_3: str | None = None
    negative_prompt_3: str | None = None
    skip_layer_guidance: SkipLayerGuidance | None = None  # SD 3.x's, with guidance (None: none)
    size_conditioning: SizeConditioning | None = None  # SDXL's sizes and crops (None: the pipeline's defaults)
    # Its own schedule (diffusers' ``timesteps`` or ``sigmas``, which then run ``num_inference_steps``;
    # None: the scheduler's for that many steps).
    timesteps: tuple[int, ...] | None = None
    sigmas: tuple[float, ...] | None = None
    eta: float = 0.0  # DDIM's eta: the fresh noise each step adds, as a share of DDPM's (0: none)

    @property
    def images(self) -> int:
        return len(self.seeds)

    def custom_schedule(self) -> dict[str, list[float]]:
        """Its own schedule as ``set_timesteps`` takes it (empty: none)."""
        given = {"timesteps": self.timesteps, "sigmas": self.sigmas}
        return {field: list(values) for field, values in given.items() if values is not None}

    @property
    def guided(self) -> bool:
        """Classifier-free guidance, as the pipeline decides it."""
        return guided_at(self.guidance_scale)

    @property
    def rows(self) -> int:
        """Rows of its denoiser forwards: its images, twice with guidance (a step with skip-layer
        guidance adds its images once more: ``DenoiseJob.rows``)."""
        return self.images * (2 if self.guided else 1)

    @property
    def most_rows(self) -> int:
        """Rows of its largest forward: with skip-layer guidance, its images once more (what
        admission checks against memory, whether or not its window holds a step)."""
        return self.rows + (self.images if self.guided and self.skip_layer_guidance is not None else 0)


@dataclass(frozen=True)
class Inpainting:
    """What an inpainting job puts back after each step: the image's latents, the noise they are
    noised with, and the latent-size mask (1 where the image is repainted)."""

    image_latents: torch.Tensor
    noise: torch.Tensor
    mask: torch.Tensor
    table: torch.Tensor  # what its noising reads, on the device (schedules.noise_table)

    def blend(
        self, family: Family, scheduler: Scheduler, latents: torch.Tensor, next_timestep: torch.Tensor | None
    ) -> torch.Tensor:
        """The inpaint pipeline's step end for a 4- or 16-channel denoiser: outside the mask, the
        image at the next noise level (``next_timestep``: a one-element device tensor, None after
        the last step)."""
        proper = self.image_latents
        if next_timestep is not None:
            proper = schedules.noised(family, scheduler, proper, self.noise, self.table, next_timestep)
        return (1 - self.mask) * proper + self.mask * latents


@dataclass
class DenoiseJob:
    """One job's state between steps: what ``__call__`` holds in its locals."""

    spec: JobSpec
    scheduler: Scheduler
    timesteps: torch.Tensor
    latents: torch.Tensor
    conditioning: Conditioning
    step_kwargs: dict = field(default_factory=dict)
    step: int = 0
    inpainting: Inpainting | None = None
    controls: tuple[Control, ...] = ()
    host_timesteps: list[float] = field(default_factory=list)  # a CPU copy of ``timesteps``
    cache: RowCache | FirstBlockCache | None = None  # its step cache: what it keeps from its last full step
    skip_mask: torch.Tensor | None = None  # the blocks its skip-layer guidance skips, (blocks,) on the device

    def acting(self) -> list[Control]:
        """The ControlNets that act in its next step."""
        return [control for control in self.controls if control.spec.acts(self.step, self.total_steps)]

    @property
    def guided(self) -> bool:
        return self.spec.guided

    @property
    def cached_step(self) -> bool:
        """Whether its next step is a DeepCache cached step (its deep blocks reused); a first-block
        cache decides in the step's forward."""
        return isinstance(self.cache, RowCache) and not self.cache.full_step(self.step)

    @property
    def cached_steps(self) -> int:
        """The steps it ran with its cache's reused features."""
        return 0 if self.cache is None else self.cache.cached_steps

    @property
    def total_steps(self) -> int:
        return len(self.timesteps)

    @property
    def done(self) -> bool:
        return self.step >= self.total_steps

    @property
    def images(self) -> int:
        return self.latents.shape[0]

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return tuple(self.latents.shape[1:])

    @property
    def skips_layers(self) -> bool:
        """Whether its next step runs skip-layer guidance: its images once more, at the prompt's
        conditioning, with the guidance's blocks skipped (after its guided rows)."""
        guidance = self.spec.skip_layer_guidance
        return (
            guidance is not None and self.guided and guidance.scale != 0 and guidance.acts(self.step, self.total_steps)
        )

    @property
    def rows(self) -> int:
        """Rows of its next denoiser forward."""
        return self.spec.rows + (self.images if self.skips_layers else 0)

    def forward_conditioning(self) -> list[Conditioning]:
        """Its rows' conditioning in its next forward, in pieces (the forward joins them): with
        skip-layer guidance, the prompt's rows (its last ``images``, a view) once more."""
        if not self.skips_layers:
            return [self.conditioning]
        return [self.conditioning, self.conditioning.rows(slice(self.images, None))]
