"""SDXL 1.0 base's architecture with random weights: true shapes, nothing downloaded.

The UNet (2.57B parameters), the two text encoders (CLIP ViT-L/14, as SD 1.5's, and OpenCLIP
ViT-bigG/14) and the VAE (SD 1.5's layout, SDXL's scaling and float32 upcast) use SDXL base 1.0's
published configs, so ``make bench-gpu`` measures SDXL at the sizes a real model runs. Both tokenizers
are byte-level (``model_making.make_tiny_model``): prompts still become 77 tokens. Written once in
diffusers format (safetensors, float16, about 7 GB).
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
from transformers import CLIPTextModel, CLIPTextModelWithProjection

from bench import random_weights, sd15
from handler.checkpoints.single_file import shipped_config
from model_making.make_tiny_model import build_tokenizer
from server.paths import MODELS

MODEL_DIR = MODELS / "sdxl-random"
NATIVE_SIDE = 1024
SEED = 0

# The shipped architecture single files load with (handler/checkpoints/configs/sdxl).
UNET_CONFIG = shipped_config("sdxl", "unet")
VAE_CONFIG = shipped_config("sdxl", "vae")
TEXT_ENCODER_CONFIG = sd15.TEXT_ENCODER_CONFIG  # CLIP ViT-L/14
TEXT_ENCODER_2_CONFIG = random_weights.without_vocabulary(
    shipped_config("sdxl", "text_encoder_2")
)  # OpenCLIP ViT-bigG/14
SCHEDULER_CONFIG = {
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "steps_offset": 1,
    "timestep_spacing": "leading",
    "interpolation_type": "linear",
}


def build_unet() -> UNet2DConditionModel:
    return UNet2DConditionModel(**UNET_CONFIG)


def build_pipeline(seed: int = SEED) -> StableDiffusionXLPipeline:
    """SDXL base's components with weights drawn from ``seed`` (diffusers' default initialization)."""
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    return StableDiffusionXLPipeline(
        vae=AutoencoderKL(**VAE_CONFIG),
        text_encoder=CLIPTextModel(random_weights.text_config(TEXT_ENCODER_CONFIG, tokenizer)),
        text_encoder_2=CLIPTextModelWithProjection(random_weights.text_config(TEXT_ENCODER_2_CONFIG, tokenizer)),
        tokenizer=tokenizer,
        tokenizer_2=build_tokenizer(),
        unet=build_unet(),
        scheduler=EulerDiscreteScheduler(**SCHEDULER_CONFIG),
        force_zeros_for_empty_prompt=True,
        add_watermarker=False,
    )


def ensure_model(directory: Path = MODEL_DIR, seed: int = SEED) -> Path:
    """Write the pipeline to ``directory`` unless the same recipe is already there (about 7 GB)."""
    recipe = {
        "seed": seed,
        "unet": UNET_CONFIG,
        "vae": VAE_CONFIG,
        "text_encoder": TEXT_ENCODER_CONFIG,
        "text_encoder_2": TEXT_ENCODER_2_CONFIG,
    }
    return random_weights.ensure_pipeline(directory, recipe, lambda: build_pipeline(seed))


if __name__ == "__main__":
    random_weights.main(ensure_model, MODEL_DIR, __doc__.splitlines()[0])
