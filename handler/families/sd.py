"""SD 1.x and SD 2.x: ``StableDiffusionPipeline`` (diffusers 0.42.1) and its img2img and inpaint
pipelines for the model's own 4-channel UNet.

One CLIP text encoder; a UNet with cross-attention; the UNet schedulers' noise arithmetic
(``init_noise_sigma``, ``scale_model_input``, ``add_noise``; epsilon or v-prediction is the
scheduler's business, so both versions share it); the VAE's scaling factor; the model's safety
checker where it ships one (flagged images become black, as diffusers does).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    PNDMScheduler,
    StableDiffusionPipeline,
)

from handler.config import SchedulerName
from handler.families.base import (
    Conditioning,
    Decoded,
    Family,
    Pipeline,
    PromptSpec,
    Scheduler,
    SchedulerChoice,
    TextEmbedding,
)

# The UNet families' schedulers. PNDM skips its Runge-Kutta warm-up steps as Stable Diffusion's own
# PNDM configuration does (with them it needs at least 4 steps and runs 13 UNet calls for 4 steps).
SCHEDULERS: dict[SchedulerName, SchedulerChoice] = {
    "ddim": (DDIMScheduler, {}),
    "euler": (EulerDiscreteScheduler, {}),
    "euler_a": (EulerAncestralDiscreteScheduler, {}),
    "dpmpp_2m": (DPMSolverMultistepScheduler, {}),
    "pndm": (PNDMScheduler, {"skip_prk_steps": True}),
}


class StableDiffusionFamily(Family):
    """SD 1.x and SD 2.x."""

    pipeline_class: ClassVar[type] = StableDiffusionPipeline
    denoiser_name: ClassVar[str] = "unet"
    schedulers: ClassVar[dict[SchedulerName, SchedulerChoice]] = SCHEDULERS

    @classmethod
    def refuse(cls, pipeline: Pipeline) -> str | None:
        if getattr(pipeline.unet.config, "time_cond_proj_dim", None) is not None:
            return (
                f"{type(pipeline).__name__} with a guidance-embedded UNet (time_cond_proj_dim, as LCM-distilled "
                "models have) is not supported by this handler's step engine"
            )
        return None

    @property
    def name(self) -> str:
        """SD 2.x by its OpenCLIP text width (1024) or v-prediction, SD 1.x otherwise."""
        v_prediction = self.pipeline.scheduler.config.get("prediction_type") == "v_prediction"
        return "SD 2.x" if v_prediction or self.pipeline.unet.config.cross_attention_dim == 1024 else "SD 1.x"

    def _encode_texts(self, texts: list[str]) -> list[TextEmbedding]:
        hidden_states, _ = self.pipeline.encode_prompt(texts, self.device, 1, False)
        return [TextEmbedding(row) for row in hidden_states.split(1)]

    def _condition(self, spec: PromptSpec, rows: TextEmbedding) -> Conditioning:
        return Conditioning(rows.hidden_states)

    def initial_latents(self, scheduler: Any, noise: torch.Tensor) -> torch.Tensor:
        return noise * scheduler.init_noise_sigma

    def model_input(self, scheduler: Any, rows: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        return scheduler.scale_model_input(rows, timestep)

    def add_noise(
        self, scheduler: Scheduler, original: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor:
        return scheduler.add_noise(original, noise, timesteps)  # type: ignore[attr-defined]  # the UNet schedulers'

    def forward(self, latents: torch.Tensor, timesteps: torch.Tensor, conditioning: Conditioning) -> torch.Tensor:
        return self.pipeline.unet(
            latents,
            timesteps,
            encoder_hidden_states=conditioning.hidden_states,
            added_cond_kwargs=conditioning.added or None,
            return_dict=False,
        )[0]

    def encode_image(self, pixels: torch.Tensor, generators: list[torch.Generator], inpaint: bool) -> torch.Tensor:
        return self.pipeline.vae.config.scaling_factor * self._vae_encode(pixels, generators)

    def vae_decode(self, latents: torch.Tensor, tiled: bool) -> torch.Tensor:
        return self._decode(latents / self.pipeline.vae.config.scaling_factor, tiled)

    def postprocess(self, image: torch.Tensor) -> Decoded:
        """The safety checker where the model has one (flagged images black), then PIL images."""
        image, flagged = self.pipeline.run_safety_checker(image, self.device, self.dtype)
        denormalize = [True] * image.shape[0] if flagged is None else [not flag for flag in flagged]
        images = self.pipeline.image_processor.postprocess(image, output_type="pil", do_denormalize=denormalize)
        return Decoded(images, None if flagged is None else [bool(flag) for flag in flagged])
