"""Generate a tiny Stable Diffusion 1.x pipeline with random weights (the untrained default model).

Real architecture (CLIP tokenizer + text encoder, UNet2DConditionModel with cross-attention,
AutoencoderKL, DDIM scheduler), small sizes: 64x64 images, a VAE that downsamples 8x (as Stable
Diffusion's does) to 8x8 latents. Fixed seed, no downloads, saved in diffusers format with
safetensors weights. Tests that need no image quality use it; ``train_default_model`` starts
from it.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

logger = logging.getLogger("make_tiny_model")

HIDDEN_SIZE = 32


def build_tokenizer() -> CLIPTokenizer:
    """A byte-level CLIP tokenizer: every byte (and its end-of-word form) is a token, no merges."""
    symbols = list(bytes_to_unicode().values())
    tokens = symbols + [symbol + "</w>" for symbol in symbols] + ["<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(vocab={token: index for index, token in enumerate(tokens)}, merges=[], model_max_length=77)


def build_pipeline(seed: int) -> StableDiffusionPipeline:
    """Assemble the tiny pipeline with weights drawn from ``seed``."""
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=HIDDEN_SIZE,
            intermediate_size=64,
            num_hidden_layers=5,
            num_attention_heads=4,
            max_position_embeddings=77,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    unet = UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=2,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=HIDDEN_SIZE,
        attention_head_dim=8,
        norm_num_groups=32,
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=(16, 32, 64, 64),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=4,
        norm_num_groups=16,
        sample_size=64,
    )
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    return StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, help="directory to write the diffusers pipeline to")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    pipeline = build_pipeline(args.seed)
    pipeline.save_pretrained(args.output, safe_serialization=True)
    size = sum(f.stat().st_size for f in args.output.rglob("*") if f.is_file())
    logger.info("tiny Stable Diffusion pipeline (seed %d) written to %s (%.1f MB)", args.seed, args.output, size / 1e6)


if __name__ == "__main__":
    main()
