"""Stable Diffusion 1.5's architecture with random weights: true shapes, nothing downloaded.

The UNet (859.5M parameters), VAE and CLIP ViT-L/14 text encoder use SD 1.5's published configs,
so attention and convolution run at the sizes a real model runs them. Only the tokenizer differs
(byte-level, see ``scripts.make_tiny_model``); prompts still become 77 tokens of width 768. The
pipeline is written once in diffusers format (safetensors, float16) and loaded by the handler's own
loading code like any local model.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel

from scripts.make_tiny_model import build_tokenizer

logger = logging.getLogger(__name__)

MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "sd15-random"
NATIVE_SIDE = 512
SEED = 0

UNET_CONFIG = {
    "sample_size": 64,
    "in_channels": 4,
    "out_channels": 4,
    "block_out_channels": (320, 640, 1280, 1280),
    "layers_per_block": 2,
    "down_block_types": ("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
    "up_block_types": ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
    "cross_attention_dim": 768,
    "attention_head_dim": 8,
    "norm_num_groups": 32,
}
VAE_CONFIG = {
    "in_channels": 3,
    "out_channels": 3,
    "block_out_channels": (128, 256, 512, 512),
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "layers_per_block": 2,
    "latent_channels": 4,
    "norm_num_groups": 32,
    "sample_size": NATIVE_SIDE,
    "scaling_factor": 0.18215,
}
TEXT_ENCODER_CONFIG = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "projection_dim": 768,
}
SCHEDULER_CONFIG = {
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "clip_sample": False,
    "set_alpha_to_one": False,
    "steps_offset": 1,
}
_STAMP = "sd15-random.json"


def build_unet() -> UNet2DConditionModel:
    return UNet2DConditionModel(**UNET_CONFIG)


def build_pipeline(seed: int = SEED) -> StableDiffusionPipeline:
    """SD 1.5's components with weights drawn from ``seed`` (diffusers' default initialization)."""
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=49408,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **TEXT_ENCODER_CONFIG,
        )
    )
    return StableDiffusionPipeline(
        vae=AutoencoderKL(**VAE_CONFIG),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=build_unet(),
        scheduler=DDIMScheduler(**SCHEDULER_CONFIG),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def _recipe(seed: int) -> dict:
    return {"seed": seed, "unet": UNET_CONFIG, "vae": VAE_CONFIG, "text_encoder": TEXT_ENCODER_CONFIG}


def ensure_model(directory: Path = MODEL_DIR, seed: int = SEED) -> Path:
    """Write the pipeline to ``directory`` unless the same recipe is already there (about 2 GB)."""
    stamp = directory / _STAMP
    recipe = json.loads(json.dumps(_recipe(seed)))
    if stamp.is_file() and json.loads(stamp.read_text()) == recipe:
        return directory
    logger.info("building SD 1.5-architecture pipeline with random weights in %s (once, about 2 GB)", directory)
    pipeline = build_pipeline(seed).to(torch.float16)
    pipeline.save_pretrained(directory, safe_serialization=True)
    stamp.write_text(json.dumps(recipe, indent=2))
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, nargs="?", default=MODEL_DIR)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logger.info("SD 1.5-architecture pipeline ready in %s", ensure_model(args.output))


if __name__ == "__main__":
    main()
