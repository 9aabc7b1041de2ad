"""Stable Diffusion 3.5 Medium's architecture with random weights: true shapes, nothing downloaded.

The MMDiT-X transformer (24 layers of 24 heads of 64, RMS-norm on queries and keys, dual attention
in layers 0 to 12, 2.5B parameters), the 16-channel VAE with SD 3's shift and scaling factors, the
CLIP-L and CLIP-G text encoders with projections and the T5-XXL encoder use the published configs
(``stabilityai/stable-diffusion-3.5-medium``), so ``make bench-gpu`` and ``make bench-engine``
measure it at the sizes a real model runs. Tokenizers are byte-level
(``model_making.make_tiny_model``): prompts still become 77 CLIP tokens and 256 T5 tokens.
Written once in diffusers format (safetensors, float16): about 16 GB with T5, 6.4 GB without it
(``with_t5=False``: what fits a 24 GiB CPU machine, which then serves with
``handler.text_encoder_3: false``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from transformers import CLIPTextModelWithProjection, T5Config, T5EncoderModel

from bench import random_weights, sd15, sdxl
from handler.checkpoints.single_file import shipped_config
from model_making.make_tiny_model import build_t5_tokenizer, build_tokenizer
from server.paths import MODELS

MODEL_DIR = MODELS / "sd35-medium-random"
WITHOUT_T5_DIR = MODELS / "sd35-medium-random-no-t5"
NATIVE_SIDE = 1024
SEED = 0

# The shipped architecture single files load with (handler/checkpoints/configs/sd35-medium).
TRANSFORMER_CONFIG = shipped_config("sd35-medium", "transformer")
VAE_CONFIG = shipped_config("sd35-medium", "vae")
TEXT_ENCODER_CONFIG = sd15.TEXT_ENCODER_CONFIG  # CLIP ViT-L/14, with its projection
TEXT_ENCODER_2_CONFIG = sdxl.TEXT_ENCODER_2_CONFIG  # OpenCLIP ViT-bigG/14, with its projection
T5_CONFIG = {  # google/t5-v1_1-xxl's encoder
    key: value
    for key, value in shipped_config("sd35-medium", "text_encoder_3").items()
    if key not in ("architectures", "pad_token_id", "eos_token_id")
}
SCHEDULER_CONFIG = shipped_config("sd35-medium", "scheduler")


def build_pipeline(seed: int = SEED, with_t5: bool = True) -> StableDiffusion3Pipeline:
    """SD 3.5 Medium's components with weights drawn from ``seed`` (diffusers' and transformers'
    default initialization), drawn on the GPU where there is one (T5-XXL alone is 4.7B parameters),
    in float16 on the CPU."""
    torch.manual_seed(seed)
    tokenizer, t5_tokenizer = build_tokenizer(), build_t5_tokenizer()
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        t5 = T5EncoderModel(T5Config(**T5_CONFIG, pad_token_id=0, eos_token_id=1)) if with_t5 else None
        pipeline = StableDiffusion3Pipeline(
            transformer=SD3Transformer2DModel(**TRANSFORMER_CONFIG),
            scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
            vae=AutoencoderKL(**VAE_CONFIG),
            text_encoder=CLIPTextModelWithProjection(random_weights.text_config(TEXT_ENCODER_CONFIG, tokenizer)),
            tokenizer=tokenizer,
            text_encoder_2=CLIPTextModelWithProjection(random_weights.text_config(TEXT_ENCODER_2_CONFIG, tokenizer)),
            tokenizer_2=build_tokenizer(),
            text_encoder_3=t5,
            tokenizer_3=t5_tokenizer if with_t5 else None,
        )
    return pipeline.to(torch.float16).to("cpu")  # cast where drawn: in float32 it is 32 GB on the host


def ensure_model(directory: Path | None = None, seed: int = SEED, with_t5: bool = True) -> Path:
    """Write the pipeline to ``directory`` (by default ``MODEL_DIR``, or ``WITHOUT_T5_DIR`` without
    T5) unless the same recipe is already there."""
    directory = directory or (MODEL_DIR if with_t5 else WITHOUT_T5_DIR)
    recipe = {
        "seed": seed,
        "transformer": TRANSFORMER_CONFIG,
        "vae": VAE_CONFIG,
        "text_encoder": TEXT_ENCODER_CONFIG,
        "text_encoder_2": TEXT_ENCODER_2_CONFIG,
        "text_encoder_3": T5_CONFIG if with_t5 else None,
    }
    return random_weights.ensure_pipeline(directory, recipe, lambda: build_pipeline(seed, with_t5))


def ensure_model_without_t5(directory: Path | None = None) -> Path:
    return ensure_model(directory, with_t5=False)


if __name__ == "__main__":
    random_weights.main(ensure_model, MODEL_DIR, __doc__.splitlines()[0])
