"""The step-level denoising engine: one request is one job that advances one step at a time.

Mirrors diffusers 0.42.1: ``StableDiffusionPipeline.__call__`` (SD 1.x, SD 2.x) and
``StableDiffusionXLPipeline.__call__`` (SDXL), cut at the denoising loop so jobs can join and
leave between steps. Their numbered steps map to:

- ``start``: 3. encode the prompts of the jobs started together in one call and 7. SDXL's added
  time ids (``handler.families``); 4. each job's own scheduler and timesteps (a copy of one built
  per scheduler and step count); 5. initial latents from one CPU generator per image, scaled by
  the scheduler's ``init_noise_sigma``; 6. ``prepare_extra_step_kwargs`` (eta 0 and the
  generators, where the scheduler takes them).
- ``step``: one iteration of the denoising loop (SD 7 / SDXL 8) for any set of jobs of one
  latent shape, in ONE UNet forward: each job's rows (doubled for classifier-free guidance when
  its guidance scale is above 1) at its own timestep, then per job the guidance and its own
  ``scheduler.step``.
- ``decode``: the end of ``__call__``: VAE decode (SDXL: float32 upcast, latents mean and std),
  the safety checker (SD, where the model has one) or the watermark (SDXL), PIL images.

Left out, because no request can ask for it: ``guidance_rescale``, ``clip_skip``,
``cross_attention_kwargs`` and LoRA scales, IP-Adapter images, caller-supplied latents, embeddings,
timesteps or sigmas, ``denoising_end``, ``prompt_2``/``negative_prompt_2`` and SDXL's negative
size conditioning, output types other than PIL, step callbacks. UNets with a guidance embedding
(``time_cond_proj_dim``, LCM) are refused at load. Different by design: jobs of one shape share
one UNet forward, so an image equals diffusers' to float rounding, not bit for bit; SDXL's VAE is
kept in float32 instead of being upcast around each decode (same arithmetic).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    PNDMScheduler,
)
from diffusers.utils.torch_utils import randn_tensor

from handler.config import FaultInjection
from handler.families import Conditioning, Decoded, Pipeline, Scheduler, StableDiffusionFamily

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
    scheduler: str
    guidance_scale: float

    @property
    def images(self) -> int:
        return len(self.seeds)

    @property
    def guided(self) -> bool:
        """Classifier-free guidance, as the pipeline decides it."""
        return self.guidance_scale > 1

    @property
    def unet_rows(self) -> int:
        """Rows of every UNet forward of this job: its images, twice with guidance."""
        return self.images * (2 if self.guided else 1)


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

    @property
    def guided(self) -> bool:
        return self.spec.guided

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
    def unet_rows(self) -> int:
        return self.spec.unet_rows


@dataclass
class StepEngine:
    """Starts, steps and decodes ``DenoiseJob``s with one loaded pipeline and its family."""

    pipeline: Pipeline
    family: StableDiffusionFamily
    device: torch.device
    dtype: torch.dtype
    description: str
    fault_injection: FaultInjection = field(default_factory=FaultInjection)
    _schedulers: dict[tuple[str, int], Scheduler] = field(default_factory=dict, init=False, repr=False)

    def latent_shape(self, width: int, height: int) -> tuple[int, int, int]:
        """Channels, height and width of one image's latents."""
        scale = self.pipeline.vae_scale_factor
        return self.pipeline.unet.config.in_channels, height // scale, width // scale

    def start(self, specs: Sequence[JobSpec]) -> list[DenoiseJob]:
        """``__call__`` steps 3 to 7 for jobs started together: their prompts through the text
        encoder(s) in one call, then each job's scheduler, latents and step arguments."""
        conditionings = self.family.encode(specs)
        return [self._start(spec, conditioning) for spec, conditioning in zip(specs, conditionings, strict=True)]

    def _start(self, spec: JobSpec, conditioning: Conditioning) -> DenoiseJob:
        """Steps 4 to 6 for one job with its encoded prompt."""
        with torch.inference_mode():
            scheduler = self._scheduler(spec.scheduler, spec.num_inference_steps)
            generators = [torch.Generator("cpu").manual_seed(seed) for seed in spec.seeds]
            shape = (spec.images, *self.latent_shape(spec.width, spec.height))
            latents = randn_tensor(
                shape, generator=generators, device=self.device, dtype=conditioning.hidden_states.dtype
            )
            latents = latents * scheduler.init_noise_sigma
        self.family.prepare_scheduler(scheduler)
        return DenoiseJob(
            spec, scheduler, scheduler.timesteps, latents, conditioning, _step_kwargs(scheduler, generators)
        )

    def _scheduler(self, name: str, steps: int) -> Scheduler:
        """A fresh scheduler with ``steps`` timesteps (step 4): a copy of one built and set once per
        (scheduler, steps), which costs a fifth of building it from the model's config."""
        template = self._schedulers.get((name, steps))
        if template is None:
            scheduler_class, overrides = SCHEDULERS[name]
            template = scheduler_class.from_config(self.pipeline.scheduler.config, **overrides)
            template.set_timesteps(steps, device=self.device)
            self._schedulers[(name, steps)] = template
        return copy.deepcopy(template)

    def step(self, jobs: list[DenoiseJob]) -> None:
        """Advance every job one step with ONE UNet forward. All jobs must share a latent shape."""
        shapes = {job.latent_shape for job in jobs}
        if len(shapes) != 1:
            raise ValueError(f"one UNet forward needs one latent shape, got {sorted(shapes)}")
        self._simulate_out_of_memory(
            "step",
            sum(job.images for job in jobs) * jobs[0].spec.width * jobs[0].spec.height,
            self.fault_injection.out_of_memory_above_pixels,
        )
        with torch.inference_mode():
            inputs, timesteps = [], []
            for job in jobs:
                timestep = job.timesteps[job.step]
                rows = torch.cat([job.latents] * 2) if job.guided else job.latents
                inputs.append(job.scheduler.scale_model_input(rows, timestep))
                timesteps.append(timestep.float().expand(job.unet_rows))
            hidden_states, added = Conditioning.concat([job.conditioning for job in jobs])
            noise = self.pipeline.unet(
                torch.cat(inputs),
                torch.cat(timesteps),
                encoder_hidden_states=hidden_states,
                added_cond_kwargs=added,
                return_dict=False,
            )[0]
            for job, job_noise in zip(jobs, noise.split([job.unet_rows for job in jobs]), strict=True):
                if job.guided:
                    unconditional, conditional = job_noise.chunk(2)
                    job_noise = unconditional + job.spec.guidance_scale * (conditional - unconditional)
                timestep = job.timesteps[job.step]
                job.latents = job.scheduler.step(
                    job_noise, timestep, job.latents, **job.step_kwargs, return_dict=False
                )[0]
                job.step += 1

    def decode(self, latents: torch.Tensor, width: int, height: int, tiled: bool = False) -> Decoded:
        """The end of ``__call__`` for finished latents of one shape (``tiled``: the VAE decodes in
        overlapping tiles, which needs less memory and may differ slightly at the seams)."""
        if not tiled:
            self._simulate_out_of_memory(
                "VAE decode", latents.shape[0] * width * height, self.fault_injection.vae_out_of_memory_above_pixels
            )
        with torch.inference_mode():
            return self.family.postprocess(self.family.vae_decode(latents, tiled))

    @staticmethod
    def _simulate_out_of_memory(stage: str, pixels: int, limit: int | None) -> None:
        """Fault injection: out of memory above a pixel count (off unless configured)."""
        if limit is not None and pixels > limit:
            raise torch.OutOfMemoryError(
                f"simulated out of memory: {pixels} pixels in one {stage}, fault_injection allows {limit}"
            )


def _step_kwargs(scheduler: Scheduler, generators: list[torch.Generator]) -> dict:
    """``prepare_extra_step_kwargs`` with eta 0: what ``scheduler.step`` takes of eta and generator."""
    parameters = inspect.signature(scheduler.step).parameters
    kwargs: dict = {}
    if "eta" in parameters:
        kwargs["eta"] = 0.0
    if "generator" in parameters:
        kwargs["generator"] = generators
    return kwargs
