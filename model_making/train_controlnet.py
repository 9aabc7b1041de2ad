"""Train a ControlNet for the default model that puts the shape where a mask says: ``shapes-mask``.

The default model (``models/shapes-sd``) draws the colour and shape a prompt names wherever its
seed puts them. This ControlNet reads a mask (the shape's silhouette, white on black, at the image's
size) and makes the model draw the shape there, at that size: ``ControlNetModel.from_unet`` of the
model's UNet (its encoder copied, zero convolutions), trained with the model's own DDPM objective
while the UNet and the text encoder stay frozen, on the shapes the model knows, each with its mask.
Everything is drawn from one seed. ``follow_rate`` measures how well the pictures follow their maps:
the overlap (intersection over union) of the drawn shape with its mask, with and without the
ControlNet, on masks the training never saw.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from diffusers import ControlNetModel, DDPMScheduler, StableDiffusionControlNetPipeline, StableDiffusionPipeline
from diffusers.training_utils import compute_snr
from PIL import Image
from tqdm import tqdm

from model_making.shapes import ShapesDataset, ShapeSpec, coloured_mask, random_spec, render
from model_making.train_default_model import (
    add_plan_arguments,
    cosine_with_warmup,
    descend,
    posterior_means,
    to_unit_range,
    tokenize,
)

logger = logging.getLogger("train_controlnet")

NAME = "shapes-mask"
WHITE = (255, 255, 255)
# The conditioning embedding: three stride-2 convolutions (8x down, as the VAE), narrow for a 64x64 model.
EMBEDDING = (16, 32, 64, 64)


@dataclass(frozen=True)
class ControlNetPlan:
    """Everything a run depends on; written next to the ControlNet as ``training.json``."""

    seed: int = 0
    images: int = 4000
    steps: int = 1500
    batch_size: int = 16
    learning_rate: float = 1e-3
    empty_caption_fraction: float = 0.1
    snr_gamma: float = 5.0
    threads: int = 2


def mask_map(spec: ShapeSpec, size: int = 64) -> Image.Image:
    """The control map of a picture: its shape's silhouette, white on black."""
    silhouette = render(ShapeSpec("red", spec.shape, spec.size, spec.centre), size)
    drawn = coloured_mask(np.asarray(silhouette))
    return Image.fromarray(np.where(drawn[:, :, None], WHITE, (0, 0, 0)).astype(np.uint8))


def dataset(plan: ControlNetPlan) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """The shapes the model knows (pictures, captions) and each one's mask, in [0, 1]."""
    shapes = ShapesDataset(plan.images, plan.seed, plan.empty_caption_fraction)
    maps = np.stack([np.asarray(mask_map(spec)) for spec in shapes.specs])
    return shapes.pixels(), maps, shapes.captions


def controlnet_loss(
    pipeline: StableDiffusionPipeline,
    controlnet: ControlNetModel,
    noise_schedule: DDPMScheduler,
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    snr_gamma: float,
    generator: torch.Generator,
) -> torch.Tensor:
    """The default model's DDPM objective (Min-SNR weighted) with the ControlNet's residuals added
    to the frozen UNet: the noise predicted given the caption and the mask, against the noise added."""
    clean, token_ids, maps = batch
    noise = torch.randn(clean.shape, generator=generator)
    timesteps = torch.randint(noise_schedule.config.num_train_timesteps, (len(clean),), generator=generator)
    noisy = noise_schedule.add_noise(clean, noise, timesteps)
    with torch.no_grad():
        encoder_hidden_states = pipeline.text_encoder(token_ids)[0]
    down, mid = controlnet(noisy, timesteps, encoder_hidden_states, controlnet_cond=maps, return_dict=False)
    prediction = pipeline.unet(
        noisy,
        timesteps,
        encoder_hidden_states,
        down_block_additional_residuals=down,
        mid_block_additional_residual=mid,
    ).sample
    snr = compute_snr(noise_schedule, timesteps)
    weights = snr.clamp(max=snr_gamma) / snr
    return (weights * torch.nn.functional.mse_loss(prediction, noise, reduction="none").mean(dim=(1, 2, 3))).mean()


def train(pipeline: StableDiffusionPipeline, plan: ControlNetPlan) -> ControlNetModel:
    torch.set_num_threads(plan.threads)
    torch.manual_seed(plan.seed)
    generator = torch.Generator().manual_seed(plan.seed)
    pixels, maps, captions = dataset(plan)
    latents = posterior_means(pipeline, to_unit_range(pixels)) * pipeline.vae.config.scaling_factor
    conditions = torch.from_numpy(maps).permute(0, 3, 1, 2).float() / 255.0  # as prepare_image makes them
    token_ids = tokenize(pipeline, captions)
    pipeline.unet.requires_grad_(False)
    pipeline.text_encoder.requires_grad_(False)
    controlnet = ControlNetModel.from_unet(pipeline.unet, conditioning_embedding_out_channels=EMBEDDING).train()
    trained = list(controlnet.parameters())
    noise_schedule = DDPMScheduler.from_config(pipeline.scheduler.config)
    optimizer = torch.optim.AdamW(trained, lr=plan.learning_rate, weight_decay=1e-2)
    schedule = cosine_with_warmup(optimizer, plan.steps, warmup=50)
    running = None
    for _ in (progress := tqdm(range(plan.steps), desc="controlnet", unit="step", mininterval=5)):
        index = torch.randint(len(latents), (plan.batch_size,), generator=generator)
        batch = (latents[index], token_ids[index], conditions[index])
        loss = controlnet_loss(pipeline, controlnet, noise_schedule, batch, plan.snr_gamma, generator)
        descend(loss, optimizer, schedule, trained)
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        progress.set_postfix(loss=f"{running:.4f}", refresh=False)
    return controlnet.eval()


def overlap(image: np.ndarray, mask: Image.Image) -> float:
    """Intersection over union of the shape drawn in ``image`` with the white area of ``mask``."""
    drawn, wanted = coloured_mask(image), np.asarray(mask)[:, :, 0] > 127
    union = (drawn | wanted).sum()
    return float((drawn & wanted).sum() / union) if union else 0.0


def held_out(seed: int, count: int) -> list[ShapeSpec]:
    """Pictures the training never drew: their own seed."""
    rng = random.Random(seed + 10_000)
    return [random_spec(rng) for _ in range(count)]


def follow_rate(
    pipeline: StableDiffusionPipeline, controlnet: ControlNetModel, specs: list[ShapeSpec]
) -> dict[str, float]:
    """Mean overlap of the drawn shape with its mask (25 DDIM steps, guidance 7.5, seed k for
    picture k), with the ControlNet and without it (the base model from the same seeds)."""
    prompts = [spec.caption(with_size=False) for spec in specs]
    maps = [mask_map(spec) for spec in specs]
    generators = [torch.Generator().manual_seed(index) for index in range(len(specs))]
    controlled = StableDiffusionControlNetPipeline.from_pipe(pipeline, controlnet=controlnet)
    with torch.no_grad():
        base = pipeline(prompt=prompts, generator=generators, num_inference_steps=25, output_type="np").images
        generators = [torch.Generator().manual_seed(index) for index in range(len(specs))]
        ruled = controlled(
            prompt=prompts, image=maps, generator=generators, num_inference_steps=25, output_type="np"
        ).images
    score = {
        name: float(
            np.mean(
                [
                    overlap((image * 255).round().astype(np.uint8), mask)
                    for image, mask in zip(images, maps, strict=True)
                ]
            )
        )
        for name, images in (("base", base), ("controlnet", ruled))
    }
    return score


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path, help="the default model's diffusers directory")
    parser.add_argument("output", type=Path, help="the ControlNet directory to write")
    defaults = ControlNetPlan()
    add_plan_arguments(parser, defaults)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    plan = ControlNetPlan(**{field: getattr(args, field) for field in asdict(defaults)})
    pipeline = StableDiffusionPipeline.from_pretrained(args.model_dir, use_safetensors=True)
    pipeline.set_progress_bar_config(disable=True)
    started = time.monotonic()
    controlnet = train(pipeline, plan)
    minutes = (time.monotonic() - started) / 60
    score = follow_rate(pipeline, controlnet, held_out(plan.seed, 48))
    logger.info(
        "overlap of drawn shape and mask: %.2f without the ControlNet, %.2f with it", score["base"], score["controlnet"]
    )
    controlnet.save_pretrained(str(args.output), safe_serialization=True)
    record = {"plan": asdict(plan), "minutes": round(minutes, 1), "mask_overlap": score}
    (args.output / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    logger.info("trained in %.1f min; ControlNet written to %s", minutes, args.output)


if __name__ == "__main__":
    main()
