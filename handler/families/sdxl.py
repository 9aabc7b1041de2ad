"""SDXL: ``StableDiffusionXLPipeline`` (diffusers 0.42.1) and its img2img and inpaint pipelines for
the model's own 4-channel UNet.

What differs from SD 1.x/2.x (``handler.families.sd``): two text encoders, the second's pooled
embedding and the six size/crop time ids as the UNet's added conditioning (a request's sizes and crop
as each pipeline reads them: ``time_id_sizes``), zeros for an absent
negative prompt (``force_zeros_for_empty_prompt``); the VAE in float32 where it asks for it
(``force_upcast``) and its latents mean and std where it has them (the img2img pipeline's encode,
every decode, not the inpaint pipeline's encode); the watermarker where one is installed, no safety
checker.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from diffusers import StableDiffusionXLPipeline

from handler.config import SizeConditioning
from handler.families.base import Conditioning, Decoded, Family, Pipeline, PromptSpec, TextEmbedding
from handler.families.sd import StableDiffusionFamily
from handler.families.transfer import to_device


class StableDiffusionXLFamily(StableDiffusionFamily):
    """SDXL."""

    pipeline_class: ClassVar[type] = StableDiffusionXLPipeline
    clip_layer_from_last: ClassVar[int] = 2  # the penultimate hidden states
    takes_size_conditioning: ClassVar[bool] = True

    def __init__(self, pipeline: Pipeline, device: torch.device, dtype: torch.dtype, max_sequence_length: int = 256):
        super().__init__(pipeline, device, dtype, max_sequence_length)
        # diffusers upcasts a float16 VAE that asks for it around every decode; keeping it in
        # float32 gives the same arithmetic without copying the weights twice per decode.
        vae = pipeline.vae
        if vae.dtype == torch.float16 and vae.config.force_upcast:
            vae.to(dtype=torch.float32)

    @property
    def name(self) -> str:
        return "SDXL"

    @property
    def text_encoders(self) -> int:
        return 2  # prompt_2: the second's

    @property
    def zeros_without_negative(self) -> bool:  # force_zeros_for_empty_prompt
        return bool(self.pipeline.config.force_zeros_for_empty_prompt)

    def _encode_texts(self, texts: list[tuple[str, ...]], clip_skip: int | None) -> list[TextEmbedding]:
        """Both text encoders (``encode_prompt``): hidden states, and the second's pooled embedding."""
        prompts, prompts_2 = (list(column) for column in zip(*texts, strict=True))
        hidden_states, _, pooled, _ = self.pipeline.encode_prompt(
            prompt=prompts,
            prompt_2=prompts_2,
            device=self.device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=False,
            clip_skip=clip_skip,
        )
        return [
            TextEmbedding(row, pooled_row)
            for row, pooled_row in zip(hidden_states.split(1), pooled.split(1), strict=True)
        ]

    def _condition(self, spec: PromptSpec, rows: TextEmbedding) -> Conditioning:
        """``__call__`` steps 3 and 7 for one job's rows: embeddings and pooled embeddings, and the
        time ids of its sizes and crop (``time_id_sizes``), the unguided rows' first with guidance,
        each row its own side's (diffusers' text-to-image pipelines repeat the [negative; positive]
        pair per image instead, which pairs some rows of several images with the other side's where
        the two differ; its img2img and inpaint pipelines pair them as here)."""
        pipeline, pooled = self.pipeline, rows.pooled
        assert pooled is not None  # SDXL's second encoder pools
        projection_dim = (
            int(pooled.shape[-1]) if pipeline.text_encoder_2 is None else pipeline.text_encoder_2.config.projection_dim
        )
        negative, positive = (
            pipeline._get_add_time_ids(
                *sizes, dtype=rows.hidden_states.dtype, text_encoder_projection_dim=projection_dim
            ).repeat(spec.images, 1)
            for sizes in time_id_sizes(spec)
        )
        time_ids = (torch.cat([negative, positive]) if spec.guided else positive).to(self.device)
        return Conditioning(
            rows.hidden_states.to(self.device), {"text_embeds": pooled.to(self.device), "time_ids": time_ids}
        )

    def encode_image(self, pixels: torch.Tensor, generators: list[torch.Generator], inpaint: bool) -> torch.Tensor:
        """In the VAE's dtype (float32 where it asks for the upcast), back in the pipeline's dtype;
        the img2img pipeline applies the VAE's latents mean and std, the inpaint one does not."""
        vae = self.pipeline.vae
        latents = self._vae_encode(pixels.to(vae.dtype), generators).to(pixels.dtype)
        statistics = self._latents_statistics(latents)
        if inpaint or statistics is None:
            return vae.config.scaling_factor * latents
        mean, std = statistics
        return (latents - mean) * vae.config.scaling_factor / std

    def vae_decode(self, latents: torch.Tensor, tiled: bool) -> torch.Tensor:
        vae = self.pipeline.vae
        latents = latents.to(vae.dtype)
        statistics = self._latents_statistics(latents)
        if statistics is None:
            return self._decode(latents / vae.config.scaling_factor, tiled)
        mean, std = statistics
        return self._decode(latents * std / vae.config.scaling_factor + mean, tiled)

    def _latents_statistics(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The VAE's latents mean and std, shaped and placed like ``like``; None where it has none."""
        config = self.pipeline.vae.config
        mean, std = getattr(config, "latents_mean", None), getattr(config, "latents_std", None)
        if mean is None or std is None:
            return None
        return tuple(  # type: ignore[return-value]  # two
            to_device(torch.tensor(values).view(1, 4, 1, 1), like.device, like.dtype) for values in (mean, std)
        )

    def postprocess(self, image: torch.Tensor) -> Decoded:
        if self.pipeline.watermark is not None:
            image = self.pipeline.watermark.apply_watermark(image)
        return Family.postprocess(self, image)  # no safety checker


Sizes = tuple[tuple[int, int], tuple[int, int], tuple[int, int]]  # original size, crop's top left, target size


def time_id_sizes(spec: PromptSpec) -> tuple[Sizes, Sizes]:
    """The (original size, crop, target size) of a job's unguided and guided rows, as its pipeline
    reads the request's (``__call__``'s step 7): the sizes default to the image's, the crop to (0, 0).
    ``StableDiffusionXLPipeline`` (and its ControlNet pipeline) give the unguided rows their own only
    where both negative sizes are given (then with the negative crop), the positive ones otherwise;
    the img2img and inpaint pipelines take each negative size left out from the positive one, and
    the positive crop (``_get_add_time_ids`` without aesthetic scores)."""
    given = spec.size_conditioning or SizeConditioning()
    size = (spec.height, spec.width)
    original, target = given.original_size or size, given.target_size or size
    positive = (original, given.crops_coords_top_left or (0, 0), target)
    negative_original, negative_target = given.negative_original_size, given.negative_target_size
    if spec.image is not None:
        return (negative_original or original, positive[1], negative_target or target), positive
    if negative_original is None or negative_target is None:
        return positive, positive
    return (negative_original, given.negative_crops_coords_top_left or (0, 0), negative_target), positive
