"""Train the default model: the tiny Stable Diffusion pipeline, taught shapes and colours on this CPU.

Same architecture as ``make_tiny_model`` (CLIP tokenizer and text encoder, AutoencoderKL,
UNet2DConditionModel, DDIM scheduler). Two stages on the synthetic dataset of ``model_making.shapes``:
1. the VAE learns to reconstruct 64x64 pictures (MSE plus a small KL term); its latents' spread
   sets ``scaling_factor``;
2. the UNet and the text encoder learn to predict the noise added to those latents (DDPM
   objective with Min-SNR weighting), with a share of empty captions so that classifier-free
   guidance works; the weights kept are an exponential moving average.
Everything is drawn from one seed, so a run with the same arguments on the same machine gives the
same weights.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler, StableDiffusionPipeline
from diffusers.training_utils import EMAModel, compute_snr
from tqdm import tqdm

from model_making.make_tiny_model import build_pipeline
from model_making.shapes import COLOURS, SHAPES, Judgement, ShapesDataset, accuracy, dominant_colour, shape_of

logger = logging.getLogger("train_default_model")


@dataclass(frozen=True)
class TrainingPlan:
    """Everything a run depends on; written next to the weights as ``training.json``."""

    seed: int = 0
    images: int = 6000
    vae_steps: int = 800
    vae_batch_size: int = 8
    vae_learning_rate: float = 1e-3
    vae_kl_weight: float = 1e-6
    unet_steps: int = 4000
    unet_batch_size: int = 32
    unet_learning_rate: float = 1e-3
    text_encoder_learning_rate: float = 1e-4
    empty_caption_fraction: float = 0.1
    snr_gamma: float = 5.0
    ema_decay: float = 0.999
    threads: int = 2


def to_unit_range(pixels: np.ndarray) -> torch.Tensor:
    """uint8 (N, H, W, 3) to float (N, 3, H, W) in [-1, 1], the VAE's input range."""
    return torch.from_numpy(pixels).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)


def cosine_with_warmup(optimizer: torch.optim.Optimizer, steps: int, warmup: int) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + np.cos(np.pi * (step - warmup) / max(1, steps - warmup)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def train_vae(
    pipeline: StableDiffusionPipeline, images: torch.Tensor, plan: TrainingPlan, generator: torch.Generator
) -> None:
    """Stage 1: reconstruction of the dataset's pictures."""
    vae = pipeline.vae.train()
    optimizer = torch.optim.AdamW(vae.parameters(), lr=plan.vae_learning_rate, weight_decay=0.0)
    schedule = cosine_with_warmup(optimizer, plan.vae_steps, warmup=50)
    progress = tqdm(range(plan.vae_steps), desc="vae", unit="step", mininterval=5)
    for _ in progress:
        batch = images[torch.randint(len(images), (plan.vae_batch_size,), generator=generator)]
        posterior = vae.encode(batch).latent_dist
        latents = posterior.sample(generator=generator)
        reconstruction = vae.decode(latents).sample
        reconstruction_loss = F.mse_loss(reconstruction, batch)
        loss = reconstruction_loss + plan.vae_kl_weight * posterior.kl().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        progress.set_postfix(mse=f"{reconstruction_loss.item():.4f}", refresh=False)
    vae.eval()


@torch.no_grad()
def encode_latents(pipeline: StableDiffusionPipeline, images: torch.Tensor) -> torch.Tensor:
    """The dataset's latents (posterior means), scaled to unit spread; sets the VAE's scaling_factor."""
    latents = posterior_means(pipeline, images)
    scaling_factor = float(1.0 / latents.std())
    pipeline.vae.register_to_config(scaling_factor=scaling_factor)
    logger.info("latent std %.3f: scaling_factor %.4f", 1.0 / scaling_factor, scaling_factor)
    return latents * scaling_factor


@torch.no_grad()
def posterior_means(pipeline: StableDiffusionPipeline, images: torch.Tensor) -> torch.Tensor:
    """The VAE's latents (posterior means, unscaled) of pictures in [-1, 1]."""
    return torch.cat([pipeline.vae.encode(chunk).latent_dist.mean for chunk in images.split(256)])


def tokenize(pipeline: StableDiffusionPipeline, captions: list[str]) -> torch.Tensor:
    return pipeline.tokenizer(
        captions,
        padding="max_length",
        max_length=pipeline.tokenizer.model_max_length,
        truncation=True,
        return_tensors="pt",
    ).input_ids


def denoising_loss(
    pipeline: StableDiffusionPipeline,
    noise_schedule: DDPMScheduler,
    latents: torch.Tensor,
    token_ids: torch.Tensor,
    batch_size: int,
    snr_gamma: float,
    generator: torch.Generator,
) -> torch.Tensor:
    """The DDPM objective on a random batch: the noise the UNet predicts, conditioned on the text
    encoder's captions, against the noise added, with Min-SNR weighting (the easy, low-noise
    timesteps stop dominating the gradient)."""
    index = torch.randint(len(latents), (batch_size,), generator=generator)
    clean = latents[index]
    noise = torch.randn(clean.shape, generator=generator)
    timesteps = torch.randint(noise_schedule.config.num_train_timesteps, (len(index),), generator=generator)
    noisy = noise_schedule.add_noise(clean, noise, timesteps)
    encoder_hidden_states = pipeline.text_encoder(token_ids[index])[0]
    prediction = pipeline.unet(noisy, timesteps, encoder_hidden_states).sample
    snr = compute_snr(noise_schedule, timesteps)
    weights = snr.clamp(max=snr_gamma) / snr
    return (weights * F.mse_loss(prediction, noise, reduction="none").mean(dim=(1, 2, 3))).mean()


def descend(
    loss: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    trained: list[torch.nn.Parameter],
) -> None:
    """One optimizer step on ``loss``, the gradient clipped to norm 1."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(trained, 1.0)
    optimizer.step()
    schedule.step()


def add_plan_arguments(parser: argparse.ArgumentParser, defaults: Any) -> None:
    """A ``--field-name`` option per field of a plan dataclass, defaulting to ``defaults``."""
    for field, default in asdict(defaults).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(default), default=default)


def train_denoiser(
    pipeline: StableDiffusionPipeline,
    latents: torch.Tensor,
    token_ids: torch.Tensor,
    plan: TrainingPlan,
    generator: torch.Generator,
) -> None:
    """Stage 2: noise prediction by the UNet, conditioned on the (also trained) text encoder."""
    unet, text_encoder = pipeline.unet.train(), pipeline.text_encoder.train()
    noise_schedule = DDPMScheduler.from_config(pipeline.scheduler.config)
    optimizer = torch.optim.AdamW(
        [
            {"params": unet.parameters(), "lr": plan.unet_learning_rate},
            {"params": text_encoder.parameters(), "lr": plan.text_encoder_learning_rate},
        ],
        weight_decay=1e-2,
    )
    schedule = cosine_with_warmup(optimizer, plan.unet_steps, warmup=100)
    trained = [*unet.parameters(), *text_encoder.parameters()]
    ema = EMAModel(trained, decay=plan.ema_decay, use_ema_warmup=True, power=3 / 4)
    progress = tqdm(range(plan.unet_steps), desc="unet", unit="step", mininterval=5)
    running = None
    for _ in progress:
        loss = denoising_loss(
            pipeline, noise_schedule, latents, token_ids, plan.unet_batch_size, plan.snr_gamma, generator
        )
        descend(loss, optimizer, schedule, trained)
        ema.step(trained)
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        progress.set_postfix(loss=f"{running:.4f}", refresh=False)
    ema.copy_to(trained)
    unet.eval()
    text_encoder.eval()


@torch.no_grad()
def evaluate(
    pipeline: StableDiffusionPipeline, seeds: range = range(4), steps: int = 25, guidance_scale: float = 7.5
) -> dict[str, float]:
    """Generate every colour x shape prompt for ``seeds`` and read colour and shape back."""
    asked = [(colour, shape, seed) for colour in COLOURS for shape in SHAPES for seed in seeds]
    images = pipeline(
        prompt=[f"a {colour} {shape}" for colour, shape, _ in asked],
        generator=[torch.Generator().manual_seed(seed) for *_, seed in asked],
        num_inference_steps=steps,
        guidance_scale=guidance_scale,
        output_type="np",
    ).images
    pixels = (images * 255).round().astype(np.uint8)
    judgements = [
        Judgement(c, s, seed, dominant_colour(p), shape_of(p)) for (c, s, seed), p in zip(asked, pixels, strict=True)
    ]
    return accuracy(judgements)


def train(plan: TrainingPlan) -> StableDiffusionPipeline:
    """Both stages from ``plan.seed``; returns the trained pipeline."""
    torch.set_num_threads(plan.threads)
    generator = torch.Generator().manual_seed(plan.seed)
    pipeline = build_pipeline(plan.seed)
    dataset = ShapesDataset(plan.images, plan.seed, plan.empty_caption_fraction)
    images = to_unit_range(dataset.pixels())
    logger.info("dataset: %d captioned 64x64 pictures (seed %d)", len(dataset), plan.seed)
    train_vae(pipeline, images, plan, generator)
    latents = encode_latents(pipeline, images)
    train_denoiser(pipeline, latents, tokenize(pipeline, dataset.captions), plan, generator)
    return pipeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, help="directory to write the diffusers pipeline to")
    defaults = TrainingPlan()
    add_plan_arguments(parser, defaults)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    plan = TrainingPlan(**{field: getattr(args, field) for field in asdict(defaults)})
    started = time.monotonic()
    pipeline = train(plan)
    minutes = (time.monotonic() - started) / 60
    scores = evaluate(pipeline)
    logger.info(
        "in-process check, 25 DDIM steps, guidance 7.5: %s", ", ".join(f"{k} {v:.0%}" for k, v in scores.items())
    )
    pipeline.save_pretrained(args.output, safe_serialization=True)
    record = {
        "plan": asdict(plan),
        "minutes": round(minutes, 1),
        "accuracy": {k: round(v, 3) for k, v in scores.items()},
    }
    (args.output / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    logger.info("trained in %.1f min; pipeline written to %s", minutes, args.output)


if __name__ == "__main__":
    main()
