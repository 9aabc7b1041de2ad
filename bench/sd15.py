"""Stable Diffusion 1.5's architecture with random weights: true shapes, nothing downloaded.

The UNet (859.5M parameters), VAE and CLIP ViT-L/14 text encoder use SD 1.5's published configs,
so attention and convolution run at the sizes a real model runs them. Only the tokenizer differs
(byte-level, see ``model_making.make_tiny_model``); prompts still become 77 tokens of width 768. The
pipeline is written once in diffusers format (safetensors, float16) and loaded by the handler's own
loading code like any local model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from transformers import CLIPTextModel

from bench import random_weights
from handler.checkpoints.single_file import WITHOUT_SAFETY_CHECKER, shipped_config
from model_making.make_tiny_model import build_tokenizer
from server.paths import MODELS

MODEL_DIR = MODELS / "sd15-random"
NATIVE_SIDE = 512
SEED = 0

# The shipped architecture single files load with (handler/checkpoints/configs/sd1).
UNET_CONFIG = shipped_config("sd1", "unet")
VAE_CONFIG = shipped_config("sd1", "vae")
TEXT_ENCODER_CONFIG = random_weights.without_vocabulary(shipped_config("sd1", "text_encoder"))
SCHEDULER_CONFIG = {
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "clip_sample": False,
    "set_alpha_to_one": False,
    "steps_offset": 1,
}


def build_unet() -> UNet2DConditionModel:
    return UNet2DConditionModel(**UNET_CONFIG)


def build_pipeline(seed: int = SEED) -> StableDiffusionPipeline:
    """SD 1.5's components with weights drawn from ``seed`` (diffusers' default initialization)."""
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    text_encoder = CLIPTextModel(random_weights.text_config(TEXT_ENCODER_CONFIG, tokenizer))
    return StableDiffusionPipeline(
        vae=AutoencoderKL(**VAE_CONFIG),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=build_unet(),
        scheduler=DDIMScheduler(**SCHEDULER_CONFIG),
        **WITHOUT_SAFETY_CHECKER,
    )


def ensure_model(directory: Path = MODEL_DIR, seed: int = SEED) -> Path:
    """Write the pipeline to ``directory`` unless the same recipe is already there (about 2 GB)."""
    recipe = {"seed": seed, "unet": UNET_CONFIG, "vae": VAE_CONFIG, "text_encoder": TEXT_ENCODER_CONFIG}
    return random_weights.ensure_pipeline(directory, recipe, lambda: build_pipeline(seed))


if __name__ == "__main__":
    random_weights.main(ensure_model, MODEL_DIR, __doc__.splitlines()[0])
