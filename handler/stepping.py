"""Step-level denoising: requests advance side by side, one UNet forward per iteration.

The request-level engine (``TextToImage.generate``) runs a whole pipeline call at once. Here each
request is a ``DenoiseJob`` that owns what the pipeline call would hold for it: prompt embeddings,
latents, its own scheduler instance and step index, and its generators. ``StepEngine.step`` runs
one UNet forward over any set of jobs with the same latent shape, each at its own timestep and
guidance scale, so requests can join and leave between steps. Every job follows exactly the
arithmetic of ``StableDiffusionPipeline.__call__``, so a request's image is the image the
request-level engine gives it (to float rounding).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from diffusers.utils.torch_utils import randn_tensor
from PIL.Image import Image

from handler.batching import CallInputs, CallKey
from handler.pipeline import SCHEDULERS, TextToImage


@dataclass
class DenoiseJob:
    """One request's denoising state between steps."""

    key: CallKey
    scheduler: object
    timesteps: torch.Tensor
    latents: torch.Tensor
    text_embeddings: torch.Tensor  # [negative; positive] rows with guidance, positive rows without
    step_kwargs: dict = field(default_factory=dict)
    step: int = 0

    @property
    def guided(self) -> bool:
        """Classifier-free guidance, as the pipeline decides it."""
        return self.key.guidance_scale > 1

    @property
    def total_steps(self) -> int:
        return len(self.timesteps)

    @property
    def done(self) -> bool:
        return self.step >= self.total_steps

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return tuple(self.latents.shape[1:])

    @property
    def unet_rows(self) -> int:
        return self.latents.shape[0] * (2 if self.guided else 1)


class StepEngine:
    """Starts, steps and finishes ``DenoiseJob``s with one loaded Stable Diffusion pipeline."""

    def __init__(self, engine: TextToImage):
        self.engine = engine
        self.pipeline = engine.pipeline
        self.device = engine.device

    def start(self, key: CallKey, inputs: CallInputs) -> DenoiseJob:
        """Text encoding, the request's own scheduler and its initial latents (``inputs`` are the
        request's images: one prompt, negative prompt and seed per image)."""
        pipeline = self.pipeline
        scheduler_class, overrides = SCHEDULERS[key.scheduler]
        scheduler = scheduler_class.from_config(pipeline.scheduler.config, **overrides)
        scheduler.set_timesteps(key.num_inference_steps, device=self.device)
        generators = [torch.Generator("cpu").manual_seed(seed) for seed in inputs.seeds]
        guided = key.guidance_scale > 1
        with torch.inference_mode():
            positive, negative = pipeline.encode_prompt(
                inputs.prompts, self.device, 1, guided, inputs.negative_prompts
            )
            embeddings = torch.cat([negative, positive]) if guided else positive
            shape = (len(inputs.seeds), *self.latent_shape(key))
            latents = randn_tensor(shape, generator=generators, device=self.device, dtype=embeddings.dtype)
            latents = latents * scheduler.init_noise_sigma
        return DenoiseJob(key, scheduler, scheduler.timesteps, latents, embeddings, _step_kwargs(scheduler, generators))

    def latent_shape(self, key: CallKey) -> tuple[int, int, int]:
        """Channels, height and width of one image's latents."""
        scale = self.pipeline.vae_scale_factor
        return self.pipeline.unet.config.in_channels, key.height // scale, key.width // scale

    def step(self, jobs: list[DenoiseJob]) -> None:
        """Advance every job one step with ONE UNet forward. All jobs must share a latent shape."""
        shapes = {job.latent_shape for job in jobs}
        if len(shapes) != 1:
            raise ValueError(f"one UNet forward needs one latent shape, got {sorted(shapes)}")
        self._check_simulated_memory(jobs)
        with torch.inference_mode():
            inputs, embeddings, timesteps = [], [], []
            for job in jobs:
                timestep = job.timesteps[job.step]
                rows = torch.cat([job.latents] * 2) if job.guided else job.latents
                inputs.append(job.scheduler.scale_model_input(rows, timestep))
                embeddings.append(job.text_embeddings)
                timesteps.append(timestep.float().expand(job.unet_rows))
            noise = self.pipeline.unet(
                torch.cat(inputs), torch.cat(timesteps), encoder_hidden_states=torch.cat(embeddings), return_dict=False
            )[0]
            for job, job_noise in zip(jobs, noise.split([job.unet_rows for job in jobs])):
                if job.guided:
                    unconditional, conditional = job_noise.chunk(2)
                    job_noise = unconditional + job.key.guidance_scale * (conditional - unconditional)
                timestep = job.timesteps[job.step]
                job.latents = job.scheduler.step(job_noise, timestep, job.latents, **job.step_kwargs, return_dict=False)[0]
                job.step += 1

    def _check_simulated_memory(self, jobs: list[DenoiseJob]) -> None:
        """The fault injection the request-level engine has: out of memory above a pixel count."""
        limit = self.engine.out_of_memory_above_pixels
        pixels = sum(job.latents.shape[0] * job.key.width * job.key.height for job in jobs)
        if limit is not None and pixels > limit:
            raise torch.OutOfMemoryError(f"simulated out of memory: {pixels} pixels in one step, fault_injection allows {limit}")

    def finish(self, jobs: list[DenoiseJob]) -> list[list[Image]]:
        """Decode finished jobs of one latent shape with one VAE call; images per job."""
        vae = self.pipeline.vae
        with torch.inference_mode():
            latents = torch.cat([job.latents for job in jobs])
            decoded = vae.decode(latents / vae.config.scaling_factor, return_dict=False)[0]
            images = self.pipeline.image_processor.postprocess(
                decoded, output_type="pil", do_denormalize=[True] * decoded.shape[0]
            )
        owned, start = [], 0
        for job in jobs:
            owned.append(images[start : start + job.latents.shape[0]])
            start += job.latents.shape[0]
        return owned


def _step_kwargs(scheduler: object, generators: list[torch.Generator]) -> dict:
    """What the pipeline passes to ``scheduler.step``: ``eta`` 0 and the request's generators,
    where the scheduler takes them (``prepare_extra_step_kwargs``)."""
    parameters = inspect.signature(scheduler.step).parameters
    kwargs = {}
    if "eta" in parameters:
        kwargs["eta"] = 0.0
    if "generator" in parameters:
        kwargs["generator"] = generators
    return kwargs
