"""SD 1.x and SD 2.x: ``StableDiffusionPipeline`` (diffusers 0.42.1) and its img2img and inpaint
pipelines for the model's own 4-channel UNet.

One CLIP text encoder; a UNet with cross-attention; the UNet schedulers' noise arithmetic
(``init_noise_sigma``, ``scale_model_input``, ``add_noise``; epsilon or v-prediction is the
scheduler's business, so both versions share it); the VAE's scaling factor; the model's safety
checker where it ships one (flagged images become black, as diffusers does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from diffusers import (
    ControlNetModel,
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    HeunDiscreteScheduler,
    KDPM2AncestralDiscreteScheduler,
    KDPM2DiscreteScheduler,
    LMSDiscreteScheduler,
    PNDMScheduler,
    StableDiffusionPipeline,
    UniPCMultistepScheduler,
)
from diffusers.models.downsampling import Downsample2D

from handler.config import SchedulerName
from handler.families.base import (
    Conditioning,
    Decoded,
    Family,
    Pipeline,
    PromptSpec,
    Residuals,
    Scheduler,
    SchedulerChoice,
    TextEmbedding,
)

# The UNet families' schedulers. PNDM skips its Runge-Kutta warm-up steps as Stable Diffusion's own
# PNDM configuration does (with them it needs at least 4 steps and runs 13 UNet calls for 4 steps).
# The others are A1111's samplers as diffusers' scheduler overview maps them: "Euler", "Euler a", "LMS", "Heun",
# "DPM2", "DPM2 a", "DPM++ 2M", "DPM++ 2M SDE", their "Karras" variants (use_karras_sigmas) and "UniPC".
SCHEDULERS: dict[SchedulerName, SchedulerChoice] = {
    "ddim": (DDIMScheduler, {}),
    "euler": (EulerDiscreteScheduler, {}),
    "euler_a": (EulerAncestralDiscreteScheduler, {}),
    "lms": (LMSDiscreteScheduler, {}),
    "lms_karras": (LMSDiscreteScheduler, {"use_karras_sigmas": True}),
    "heun": (HeunDiscreteScheduler, {}),
    "dpm2": (KDPM2DiscreteScheduler, {}),
    "dpm2_karras": (KDPM2DiscreteScheduler, {"use_karras_sigmas": True}),
    "dpm2_a": (KDPM2AncestralDiscreteScheduler, {}),
    "dpm2_a_karras": (KDPM2AncestralDiscreteScheduler, {"use_karras_sigmas": True}),
    "dpmpp_2m": (DPMSolverMultistepScheduler, {}),
    "dpmpp_2m_karras": (DPMSolverMultistepScheduler, {"use_karras_sigmas": True}),
    "dpmpp_2m_sde": (DPMSolverMultistepScheduler, {"algorithm_type": "sde-dpmsolver++"}),
    "dpmpp_2m_sde_karras": (
        DPMSolverMultistepScheduler,
        {"use_karras_sigmas": True, "algorithm_type": "sde-dpmsolver++"},
    ),
    "unipc": (UniPCMultistepScheduler, {}),
    "pndm": (PNDMScheduler, {"skip_prk_steps": True}),
}


# What a ControlNet's config must share with the UNet's: its residuals' shapes, the conditioning it reads.
CONTROLNET_FIT = (
    "in_channels",
    "block_out_channels",
    "layers_per_block",
    "down_block_types",
    "cross_attention_dim",
    "addition_embed_type",
    "addition_time_embed_dim",
    "projection_class_embeddings_input_dim",
)


def _downsampled(sampler: torch.nn.Module, side: int) -> int:
    """A side after a down block's downsampler: ``Downsample2D``'s stride-2 convolution (padding 1
    rounds up; padding 0 pads one on the far side, which rounds down) or pooling (rounds down)."""
    conv = getattr(sampler, "conv", None)
    if not isinstance(sampler, Downsample2D) or not isinstance(conv, torch.nn.Conv2d):
        return side // 2
    padded = side + 2 * int(conv.padding[0]) + (1 if sampler.padding == 0 else 0)
    return (padded - conv.kernel_size[0]) // conv.stride[0] + 1


@contextlib.contextmanager
def flat_text_model(encoder: torch.nn.Module, clip_skip: int | None) -> Iterator[None]:
    """With a ``clip_skip``, diffusers 0.42.1's ``encode_prompt`` puts the hidden states it takes
    through ``text_encoder.text_model.final_layer_norm``. transformers 5.6 flattened
    ``CLIPTextModel`` (its ``final_layer_norm`` is its own, it has no ``text_model``), so that call
    raises (diffusers issue #14124); diffusers PR #14043 reads the model itself where it has no
    ``text_model``. During the block, with a ``clip_skip``, the model answers to ``text_model`` as
    itself (an attribute, not a submodule: its modules and state dict stay as they are)."""
    if clip_skip is None or hasattr(encoder, "text_model"):
        yield
        return
    object.__setattr__(encoder, "text_model", encoder)
    try:
        yield
    finally:
        object.__delattr__(encoder, "text_model")


def _setting(config: Any, key: str) -> Any:
    """A config value, sequences as tuples (a saved config holds lists, a built one tuples)."""
    value = getattr(config, key, None)
    return tuple(value) if isinstance(value, (list, tuple)) else value


class StableDiffusionFamily(Family):
    """SD 1.x and SD 2.x."""

    pipeline_class: ClassVar[type] = StableDiffusionPipeline
    denoiser_name: ClassVar[str] = "unet"
    schedulers: ClassVar[dict[SchedulerName, SchedulerChoice]] = SCHEDULERS
    takes_controlnets: ClassVar[bool] = True
    controlnet_class: ClassVar[Any] = ControlNetModel
    controlnet_files: ClassVar[bool] = True

    @classmethod
    def refuse(cls, pipeline: Pipeline) -> str | None:
        if getattr(pipeline.unet.config, "time_cond_proj_dim", None) is not None:
            return (
                f"{type(pipeline).__name__} with a guidance-embedded UNet (time_cond_proj_dim, as LCM-distilled "
                "models have) is not supported by this handler's step engine"
            )
        return None

    @property
    def max_steps(self) -> int | None:
        """The model's training timesteps, which every UNet schedule samples (SDXL's too), less 2:
        at 1000 of 1000 DDIM and PNDM index past their table, at 999 DPM++ 2M's image is not
        finite (diffusers 0.42.1, measured)."""
        return int(self.pipeline.scheduler.config.num_train_timesteps) - 2

    @property
    def name(self) -> str:
        """SD 2.x by its OpenCLIP text width (1024) or v-prediction, SD 1.x otherwise."""
        v_prediction = self.pipeline.scheduler.config.get("prediction_type") == "v_prediction"
        return "SD 2.x" if v_prediction or self.pipeline.unet.config.cross_attention_dim == 1024 else "SD 1.x"

    def _encode_texts(self, texts: list[tuple[str, ...]], clip_skip: int | None) -> list[TextEmbedding]:
        prompts = [prompt for (prompt,) in texts]  # one text encoder
        with flat_text_model(self.pipeline.text_encoder, clip_skip):  # on the loop thread alone, as every encoding
            hidden_states, _ = self.pipeline.encode_prompt(prompts, self.device, 1, False, clip_skip=clip_skip)
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

    def forward(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        conditioning: Conditioning,
        residuals: Residuals | None = None,
    ) -> torch.Tensor:
        down, mid = (residuals[:-1], residuals[-1]) if residuals else (None, None)
        return self.pipeline.unet(
            latents,
            timesteps,
            encoder_hidden_states=conditioning.hidden_states,
            added_cond_kwargs=conditioning.added or None,
            down_block_additional_residuals=down,
            mid_block_additional_residual=mid,
            return_dict=False,
        )[0]

    def controlnet_refusal(self, config: Any) -> str | None:
        """A ControlNet fits where its residuals fit the UNet's blocks and it reads the UNet's
        conditioning (a ControlNet for another family differs in these); global-pooling ControlNets
        (guess mode) and other conditioning channels than RGB are not served."""
        unet = self.pipeline.unet.config
        differing = [key for key in CONTROLNET_FIT if _setting(config, key) != _setting(unet, key)]
        if differing:
            settings = ", ".join(f"{key} {_setting(config, key)} (UNet: {_setting(unet, key)})" for key in differing)
            return f"it does not fit this {self.name} model's UNet: {settings}"
        if getattr(config, "global_pool_conditions", False):
            return "global-pooling ControlNets (guess mode, as shuffle) are not served"
        if getattr(config, "conditioning_channels", 3) != 3:
            return f"it takes {config.conditioning_channels}-channel control images; RGB (3) ones are served"
        return None

    def control_forward(
        self, net: Any, latents: torch.Tensor, timesteps: torch.Tensor, conditioning: Conditioning, images: torch.Tensor
    ) -> Residuals:
        down, mid = net(
            latents,
            timesteps,
            encoder_hidden_states=conditioning.hidden_states,
            controlnet_cond=images,
            conditioning_scale=1.0,
            added_cond_kwargs=conditioning.added or None,
            return_dict=False,
        )
        return [*down, mid]

    def control_zeros(self, latents: torch.Tensor, dtype: torch.dtype) -> Residuals:
        """Zeros shaped as the UNet's down-block outputs (``conv_in``'s, each resnet's, each
        downsampler's) and its mid block's, read from its modules."""
        unet = self.pipeline.unet
        rows, _, height, width = latents.shape

        def zeros(channels: int, height: int, width: int) -> torch.Tensor:
            return torch.zeros((rows, channels, height, width), dtype=dtype, device=latents.device)

        down = [zeros(unet.conv_in.out_channels, height, width)]
        for block in unet.down_blocks:
            down += [zeros(resnet.out_channels, height, width) for resnet in block.resnets]
            for sampler in block.downsamplers or ():
                height, width = _downsampled(sampler, height), _downsampled(sampler, width)
                down.append(zeros(sampler.out_channels, height, width))
        return [*down, zeros(down[-1].shape[1], height, width)]

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
