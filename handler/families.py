"""Stable Diffusion families: the parts of diffusers' pipeline calls that differ between them.

The step engine (``handler.engine``) runs the same denoising loop for every family; a family
supplies what its own diffusers pipeline does differently, using the pipeline's own methods where
it has them (``encode_prompt``, ``_get_add_time_ids``, ``run_safety_checker``, ``image_processor``):

- text conditioning: SD 1.x/2.x one text encoder; SDXL two, pooled embeddings and the six
  size/crop time ids as added conditioning, zeros for an absent negative prompt
  (``force_zeros_for_empty_prompt``); the texts of jobs started together go through the
  encoders in one call;
- the scheduler set-up: SDXL starts its schedulers at index 0 (``set_begin_index``);
- the VAE encode of an input image (img2img and inpaint pipelines): SDXL encodes in float32 where
  its VAE asks for it, and its img2img pipeline (not its inpaint one) applies the VAE's latents
  mean and std;
- the VAE decode: SDXL decodes in float32 when its VAE asks for it (``force_upcast``) and applies
  the VAE's latents mean and std where it has them;
- post-processing: SD runs the model's safety checker (flagged images become black, as diffusers
  does), SDXL its watermarker where one is installed.

The family is detected from the loaded pipeline's class; any other pipeline is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
from diffusers.image_processor import VaeImageProcessor
from PIL.Image import Image

# A loaded StableDiffusionPipeline or StableDiffusionXLPipeline (family_of tells which). diffusers
# registers a pipeline's components (unet, vae, scheduler, ...) at run time, so its classes declare
# none of them to a type checker.
Pipeline = Any


class Scheduler(Protocol):
    """What the engine uses of a diffusers scheduler (they share no typed base class)."""

    timesteps: torch.Tensor
    init_noise_sigma: float
    order: int

    def set_timesteps(self, num_inference_steps: int, device: torch.device) -> None: ...

    def scale_model_input(self, sample: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor: ...

    def step(self, model_output: torch.Tensor, timestep: torch.Tensor, sample: torch.Tensor, **kwargs: Any) -> Any: ...

    def add_noise(self, original: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor: ...


class PromptSpec(Protocol):
    """What a family conditions a job on (``handler.engine.JobSpec`` is one)."""

    @property
    def prompt(self) -> str: ...

    @property
    def negative_prompt(self) -> str | None: ...

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
    """What the UNet needs for one job's rows besides latents and timesteps: text embeddings
    ([negative; positive] with guidance) and, for SDXL, the added conditioning per row."""

    hidden_states: torch.Tensor
    added: dict[str, torch.Tensor] = field(default_factory=dict)

    @staticmethod
    def concat(items: list[Conditioning]) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        """The rows of several jobs for one UNet forward (``encoder_hidden_states``,
        ``added_cond_kwargs``)."""
        hidden = torch.cat([item.hidden_states for item in items])
        added = {name: torch.cat([item.added[name] for item in items]) for name in items[0].added}
        return hidden, added or None


@dataclass(frozen=True)
class TextEmbedding:
    """One text through the family's text encoder(s): ``(1, tokens, width)`` hidden states and,
    for SDXL, the second encoder's ``(1, width)`` pooled embedding."""

    hidden_states: torch.Tensor
    pooled: torch.Tensor | None = None

    def zeros(self) -> TextEmbedding:
        """SDXL's unconditional embedding for an absent negative prompt (``force_zeros_for_empty_prompt``)."""
        return TextEmbedding(
            torch.zeros_like(self.hidden_states), None if self.pooled is None else torch.zeros_like(self.pooled)
        )


@dataclass(frozen=True)
class Decoded:
    """Images of one decode, and per image whether the safety checker flagged it (None: no
    checker ran, as diffusers reports it)."""

    images: list[Image]
    nsfw_content_detected: list[bool] | None

    def split(self, sizes: list[int]) -> list[Decoded]:
        parts, start = [], 0
        for size in sizes:
            flags = None if self.nsfw_content_detected is None else self.nsfw_content_detected[start : start + size]
            parts.append(Decoded(self.images[start : start + size], flags))
            start += size
        return parts

    @staticmethod
    def join(parts: list[Decoded]) -> Decoded:
        images = [image for part in parts for image in part.images]
        if any(part.nsfw_content_detected is None for part in parts):
            return Decoded(images, None)
        return Decoded(images, [flag for part in parts for flag in part.nsfw_content_detected or []])


class StableDiffusionFamily:
    """SD 1.x and SD 2.x: ``StableDiffusionPipeline`` (epsilon or v-prediction is the scheduler's
    business, so both versions share the arithmetic)."""

    pipeline_class: type = StableDiffusionPipeline

    def __init__(self, pipeline: Pipeline, device: torch.device, dtype: torch.dtype):
        self.pipeline = pipeline
        self.device = device
        self.dtype = dtype
        # The inpaint pipelines' mask processor: one grey channel, binarized, not normalized.
        self.mask_processor = VaeImageProcessor(
            vae_scale_factor=pipeline.vae_scale_factor, do_normalize=False, do_binarize=True, do_convert_grayscale=True
        )

    @property
    def name(self) -> str:
        """SD 2.x by its OpenCLIP text width (1024) or v-prediction, SD 1.x otherwise."""
        v_prediction = self.pipeline.scheduler.config.get("prediction_type") == "v_prediction"
        return "SD 2.x" if v_prediction or self.pipeline.unet.config.cross_attention_dim == 1024 else "SD 1.x"

    @property
    def safety_checker(self) -> bool:
        return getattr(self.pipeline, "safety_checker", None) is not None

    def encode(self, specs: Sequence[PromptSpec]) -> list[Conditioning]:
        """``__call__`` step 3 for jobs started together: every distinct text they need (their
        prompts, and the negative prompts of guided jobs) through the text encoder(s) in ONE
        ``encode_prompt`` call, then each job's rows (``num_images_per_prompt`` of each text,
        [negative; positive] with guidance). Each text is encoded on its own row, padded to the
        tokenizer's length, so a job's rows equal its own ``encode_prompt`` call to float rounding."""
        texts = list(dict.fromkeys(text for spec in specs for text in self._texts(spec)))
        with torch.inference_mode():
            embedded = dict(zip(texts, self._encode_texts(texts), strict=True)) if texts else {}
            return [self._conditioning(spec, embedded) for spec in specs]

    def _texts(self, spec: PromptSpec) -> list[str]:
        negative = self._negative_text(spec)
        return [spec.prompt] if not spec.guided or negative is None else [spec.prompt, negative]

    def _negative_text(self, spec: PromptSpec) -> str | None:
        """What a job's unconditional rows encode: its negative prompt, "" without one (as
        ``encode_prompt`` does); None where the family conditions on zeros instead."""
        return spec.negative_prompt or ""

    def _encode_texts(self, texts: list[str]) -> list[TextEmbedding]:
        hidden_states, _ = self.pipeline.encode_prompt(texts, self.device, 1, False)
        return [TextEmbedding(row) for row in hidden_states.split(1)]

    def _conditioning(self, spec: PromptSpec, embedded: dict[str, TextEmbedding]) -> Conditioning:
        """``encode_prompt``'s output for one job: each text's rows repeated per image."""
        positive = embedded[spec.prompt].hidden_states.repeat(spec.images, 1, 1)
        if not spec.guided:
            return Conditioning(positive)
        negative = embedded[spec.negative_prompt or ""].hidden_states.repeat(spec.images, 1, 1)
        return Conditioning(torch.cat([negative, positive]))

    def prepare_scheduler(self, scheduler: Scheduler) -> None:
        """Nothing: ``StableDiffusionPipeline`` lets each scheduler find its first index."""

    def preprocess(self, image: Image, width: int, height: int, dtype: torch.dtype) -> torch.Tensor:
        """An input image as the img2img and inpaint pipelines take it: ``(1, 3, height, width)``
        in [-1, 1] (resized by the pipeline's image processor where its size differs)."""
        pixels = self.pipeline.image_processor.preprocess(image, height=height, width=width)
        return pixels.to(device=self.device, dtype=dtype)

    def preprocess_mask(self, mask: Image, width: int, height: int) -> torch.Tensor:
        """The inpaint pipelines' ``mask_condition``: ``(1, 1, height, width)``, 1 where repainted."""
        return self.mask_processor.preprocess(mask, height=height, width=width).to(self.device)

    def encode_image(self, pixels: torch.Tensor, generators: list[torch.Generator], inpaint: bool) -> torch.Tensor:
        """``prepare_latents`` / ``_encode_vae_image``: image ``i`` through the VAE encoder, its
        latents sampled with ``generators[i]``, scaled."""
        vae = self.pipeline.vae
        return vae.config.scaling_factor * self._vae_encode(pixels, generators)

    def _vae_encode(self, pixels: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
        vae = self.pipeline.vae
        return torch.cat(
            [
                vae.encode(pixels[index : index + 1]).latent_dist.sample(generator)
                for index, generator in enumerate(generators)
            ]
        )

    def vae_decode(self, latents: torch.Tensor, tiled: bool) -> torch.Tensor:
        """The VAE decode at the end of ``__call__`` (in tiles after running out of memory)."""
        vae = self.pipeline.vae
        scaled = latents / vae.config.scaling_factor
        return (vae.tiled_decode if tiled else vae.decode)(scaled, return_dict=False)[0]

    def postprocess(self, image: torch.Tensor) -> Decoded:
        """The safety checker where the model has one (flagged images black), then PIL images."""
        image, flagged = self.pipeline.run_safety_checker(image, self.device, self.dtype)
        denormalize = [True] * image.shape[0] if flagged is None else [not flag for flag in flagged]
        images = self.pipeline.image_processor.postprocess(image, output_type="pil", do_denormalize=denormalize)
        return Decoded(images, None if flagged is None else [bool(flag) for flag in flagged])


class StableDiffusionXLFamily(StableDiffusionFamily):
    """SDXL: ``StableDiffusionXLPipeline``."""

    pipeline_class = StableDiffusionXLPipeline

    def __init__(self, pipeline: Pipeline, device: torch.device, dtype: torch.dtype):
        super().__init__(pipeline, device, dtype)
        # diffusers upcasts a float16 VAE that asks for it around every decode; keeping it in
        # float32 gives the same arithmetic without copying the weights twice per decode.
        vae = pipeline.vae
        if vae.dtype == torch.float16 and vae.config.force_upcast:
            vae.to(dtype=torch.float32)

    @property
    def name(self) -> str:
        return "SDXL"

    @property
    def safety_checker(self) -> bool:
        return False

    def _negative_text(self, spec: PromptSpec) -> str | None:
        if spec.negative_prompt is None and self.pipeline.config.force_zeros_for_empty_prompt:
            return None
        return spec.negative_prompt or ""

    def _encode_texts(self, texts: list[str]) -> list[TextEmbedding]:
        """Both text encoders (``encode_prompt``): hidden states, and the second's pooled embedding."""
        hidden_states, _, pooled, _ = self.pipeline.encode_prompt(
            prompt=texts, device=self.device, num_images_per_prompt=1, do_classifier_free_guidance=False
        )
        return [
            TextEmbedding(row, pooled_row)
            for row, pooled_row in zip(hidden_states.split(1), pooled.split(1), strict=True)
        ]

    def _conditioning(self, spec: PromptSpec, embedded: dict[str, TextEmbedding]) -> Conditioning:
        """``__call__`` steps 3 and 7 for one job: embeddings and pooled embeddings per image,
        zeros for an absent negative prompt, time ids from the original and target size (the
        request's size) and a (0, 0) crop."""
        pipeline, images = self.pipeline, spec.images
        positive = embedded[spec.prompt]
        embeds, pooled = positive.hidden_states, positive.pooled
        assert pooled is not None  # SDXL's second encoder pools
        projection_dim = (
            int(pooled.shape[-1]) if pipeline.text_encoder_2 is None else pipeline.text_encoder_2.config.projection_dim
        )
        time_ids = pipeline._get_add_time_ids(
            (spec.height, spec.width),
            (0, 0),
            (spec.height, spec.width),
            dtype=embeds.dtype,
            text_encoder_projection_dim=projection_dim,
        )
        embeds, pooled = embeds.repeat(images, 1, 1), pooled.repeat(images, 1)
        if spec.guided:
            negative_text = self._negative_text(spec)
            negative = positive.zeros() if negative_text is None else embedded[negative_text]
            assert negative.pooled is not None
            embeds = torch.cat([negative.hidden_states.repeat(images, 1, 1), embeds], dim=0)
            pooled = torch.cat([negative.pooled.repeat(images, 1), pooled], dim=0)
            time_ids = torch.cat([time_ids, time_ids], dim=0)
        time_ids = time_ids.to(self.device).repeat(images, 1)
        return Conditioning(embeds.to(self.device), {"text_embeds": pooled.to(self.device), "time_ids": time_ids})

    def prepare_scheduler(self, scheduler: Scheduler) -> None:
        if hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(0)

    def encode_image(self, pixels: torch.Tensor, generators: list[torch.Generator], inpaint: bool) -> torch.Tensor:
        """SDXL's: in the VAE's dtype (float32 where it asks for the upcast), back in the pipeline's
        dtype; the img2img pipeline applies the VAE's latents mean and std, the inpaint one does not."""
        vae = self.pipeline.vae
        latents = self._vae_encode(pixels.to(vae.dtype), generators).to(pixels.dtype)
        mean, std = getattr(vae.config, "latents_mean", None), getattr(vae.config, "latents_std", None)
        if inpaint or mean is None or std is None:
            return vae.config.scaling_factor * latents
        mean = torch.tensor(mean).view(1, 4, 1, 1).to(latents.device, latents.dtype)
        std = torch.tensor(std).view(1, 4, 1, 1).to(latents.device, latents.dtype)
        return (latents - mean) * vae.config.scaling_factor / std

    def vae_decode(self, latents: torch.Tensor, tiled: bool) -> torch.Tensor:
        vae = self.pipeline.vae
        latents = latents.to(vae.dtype)
        mean, std = getattr(vae.config, "latents_mean", None), getattr(vae.config, "latents_std", None)
        if mean is not None and std is not None:
            mean = torch.tensor(mean).view(1, 4, 1, 1).to(latents.device, latents.dtype)
            std = torch.tensor(std).view(1, 4, 1, 1).to(latents.device, latents.dtype)
            latents = latents * std / vae.config.scaling_factor + mean
        else:
            latents = latents / vae.config.scaling_factor
        return (vae.tiled_decode if tiled else vae.decode)(latents, return_dict=False)[0]

    def postprocess(self, image: torch.Tensor) -> Decoded:
        if self.pipeline.watermark is not None:
            image = self.pipeline.watermark.apply_watermark(image)
        return Decoded(self.pipeline.image_processor.postprocess(image, output_type="pil"), None)


FAMILIES: tuple[type[StableDiffusionFamily], ...] = (StableDiffusionFamily, StableDiffusionXLFamily)
SUPPORTED = "StableDiffusionPipeline (SD 1.x, SD 2.x), StableDiffusionXLPipeline (SDXL)"


def family_of(pipeline: Pipeline, device: torch.device, dtype: torch.dtype) -> StableDiffusionFamily:
    """The family of a loaded pipeline, by its exact class (a subclass may change the arithmetic).
    Raises ``UnsupportedPipeline`` naming the class and the supported ones."""
    family = next((family for family in FAMILIES if type(pipeline) is family.pipeline_class), None)
    if family is None:
        raise UnsupportedPipeline(
            f"{type(pipeline).__name__} is not supported by this handler's step engine; supported: {SUPPORTED}"
        )
    if getattr(pipeline.unet.config, "time_cond_proj_dim", None) is not None:
        raise UnsupportedPipeline(
            f"{type(pipeline).__name__} with a guidance-embedded UNet (time_cond_proj_dim, as LCM-distilled "
            "models have) is not supported by this handler's step engine"
        )
    return family(pipeline, device, dtype)
