"""diffusers' own pipeline call for a request: the reference every served image is checked against
(the tests) and the step engine is timed against (``make bench-engine``).

The pipeline is loaded by diffusers alone (``AutoPipelineForText2Image``, no handler code), and
each call gets what a user of diffusers would pass for the request: one CPU generator per image
seeded ``seed + k``, the request's scheduler built from the model's own scheduler configuration as
the handler names it (``handler.engine.SCHEDULERS``), and the pipeline's defaults for everything
a request cannot set.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import AutoPipelineForText2Image, DiffusionPipeline
from PIL.Image import Image

from handler.config import MAX_SEED
from handler.engine import SCHEDULERS


@dataclass(frozen=True)
class ReferenceOutput:
    images: list[Image]
    nsfw_content_detected: list[bool] | None


class Reference:
    """One model loaded by diffusers, called as a user would call it."""

    def __init__(self, model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        self.model_dir = Path(model_dir)
        self.pipeline: DiffusionPipeline = AutoPipelineForText2Image.from_pretrained(
            str(model_dir), dtype=dtype, use_safetensors=True
        ).to(device)
        self.pipeline.set_progress_bar_config(disable=True)
        self.scheduler_config = self.pipeline.scheduler.config

    def __call__(
        self,
        prompt: str,
        seed: int,
        width: int,
        height: int,
        num_inference_steps: int,
        *,
        negative_prompt: str | None = None,
        num_images_per_prompt: int = 1,
        scheduler: str = "ddim",
        guidance_scale: float = 7.5,
    ) -> ReferenceOutput:
        """One request: ``num_images_per_prompt`` images of one prompt, image k from ``seed + k``
        (wrapping past the largest seed, as requests do)."""
        seeds = [(seed + index) % (MAX_SEED + 1) for index in range(num_images_per_prompt)]
        return self._call(
            prompt,
            negative_prompt,
            num_images_per_prompt,
            seeds,
            width,
            height,
            num_inference_steps,
            scheduler,
            guidance_scale,
        )

    def batch(
        self,
        prompts: list[str],
        seeds: list[int],
        width: int,
        height: int,
        num_inference_steps: int,
        scheduler: str = "ddim",
        guidance_scale: float = 7.5,
    ) -> ReferenceOutput:
        """Several one-image requests (prompt k from seed k) in one call, as a user batches them."""
        return self._call(prompts, None, 1, seeds, width, height, num_inference_steps, scheduler, guidance_scale)

    def _call(
        self,
        prompt: str | list[str],
        negative_prompt: str | None,
        images_per_prompt: int,
        seeds: list[int],
        width: int,
        height: int,
        num_inference_steps: int,
        scheduler: str,
        guidance_scale: float,
    ) -> ReferenceOutput:
        scheduler_class, overrides = SCHEDULERS[scheduler]
        self.pipeline.scheduler = scheduler_class.from_config(self.scheduler_config, **overrides)
        output = self.pipeline(
            prompt=prompt,
            negative_prompt=negative_prompt,
            num_images_per_prompt=images_per_prompt,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            width=width,
            height=height,
            generator=[torch.Generator("cpu").manual_seed(seed) for seed in seeds],
            output_type="pil",
        )
        return ReferenceOutput(output.images, getattr(output, "nsfw_content_detected", None))
