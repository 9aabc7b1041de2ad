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
from model_making.make_tiny_model import build_tokenizer
from server.paths import MODELS

MODEL_DIR = MODELS / "sdxl-random"
NATIVE_SIDE = 1024
SEED = 0

UNET_CONFIG = {  # SD 1.5's UNet with three blocks, deeper transformers, two text encoders' width, added conditioning
    **sd15.UNET_CONFIG,
    "sample_size": 128,
    "block_out_channels": (320, 640, 1280),
    "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    "transformer_layers_per_block": (1, 2, 10),
    "attention_head_dim": (5, 10, 20),
    "cross_attention_dim": 2048,
    "use_linear_projection": True,
    "addition_embed_type": "text_time",
    "addition_time_embed_dim": 256,
    "projection_class_embeddings_input_dim": 2816,  # 6 time ids x 256 + the 1280-wide pooled text embedding
}
VAE_CONFIG = {**sd15.VAE_CONFIG, "sample_size": NATIVE_SIDE, "scaling_factor": 0.13025, "force_upcast": True}
TEXT_ENCODER_CONFIG = sd15.TEXT_ENCODER_CONFIG  # CLIP ViT-L/14
TEXT_ENCODER_2_CONFIG = {  # OpenCLIP ViT-bigG/14
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "num_hidden_layers": 32,
    "num_attention_heads": 20,
    "max_position_embeddings": 77,
    "hidden_act": "gelu",
    "projection_dim": 1280,
}
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
