"""Train a LoRA for the default model that teaches it a style it does not know: ``outline``.

The default model (``models/shapes-sd``) was taught filled red, green, blue and yellow shapes;
asked for "a red circle outline" it draws a filled circle. (A new colour would not do: the model's
VAE never saw one and decodes, say, purple as blue.) This trains LoRA layers on the UNet's and the
text encoder's attention projections (the base weights stay frozen) with the same DDPM objective
as the default model, on outlined shapes captioned "... outline" mixed with the filled shapes the
model knows (so that the LoRA adds a style instead of replacing the old one), and writes them in
diffusers' LoRA format to a ``.safetensors`` file the server's LoRA directory serves by its stem.
Everything is drawn from one seed.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from diffusers import DDPMScheduler, StableDiffusionPipeline
from peft import LoraConfig, get_peft_model_state_dict
from PIL import Image, ImageDraw
from tqdm import tqdm

from model_making.make_lora import TEXT_TARGETS, UNET_TARGETS
from model_making.shapes import (
    BACKGROUND,
    COLOURS,
    SHAPES,
    SIZE,
    SIZES,
    ShapesDataset,
    ShapeSpec,
    coloured_mask,
    random_spec,
    render,
)
from model_making.train_default_model import (
    add_plan_arguments,
    cosine_with_warmup,
    denoising_loss,
    descend,
    posterior_means,
    to_unit_range,
    tokenize,
)

logger = logging.getLogger("train_lora")

STYLE_WORD = "outline"
OUTLINE_WIDTH = 5


@dataclass(frozen=True)
class LoraPlan:
    """Everything a run depends on; written next to the LoRA as ``<name>.json``."""

    seed: int = 0
    images: int = 2000
    outline_fraction: float = 0.5
    steps: int = 2000
    batch_size: int = 16
    rank: int = 8
    learning_rate: float = 2e-3
    empty_caption_fraction: float = 0.1
    snr_gamma: float = 5.0
    threads: int = 2


def outlined(spec: ShapeSpec) -> np.ndarray:
    """``spec`` drawn as its outline only (``OUTLINE_WIDTH`` pixels) on the plain background."""
    image = Image.new("RGB", (SIZE, SIZE), BACKGROUND)
    draw = ImageDraw.Draw(image)
    (cx, cy), radius, colour = spec.centre, SIZES[spec.size], COLOURS[spec.colour]
    if spec.shape == "circle":
        draw.ellipse((cx - radius, cy - radius, cx + radius, cy + radius), outline=colour, width=OUTLINE_WIDTH)
    elif spec.shape == "square":
        half = radius / math.sqrt(2)
        draw.rectangle((cx - half, cy - half, cx + half, cy + half), outline=colour, width=OUTLINE_WIDTH)
    else:
        corners = (0, 2 * math.pi / 3, 4 * math.pi / 3)
        draw.polygon(
            [(cx + radius * math.sin(a), cy - radius * math.cos(a)) for a in corners],
            outline=colour,
            width=OUTLINE_WIDTH,
        )
    return np.asarray(image)


def dataset(plan: LoraPlan) -> tuple[np.ndarray, list[str]]:
    """Outlined shapes captioned "a <colour> <shape> outline" (medium and large: a small one's
    outline is nearly filled), mixed with the filled shapes the model knows."""
    rng = random.Random(plan.seed)
    known = ShapesDataset(plan.images, plan.seed + 1, plan.empty_caption_fraction)
    pixels, captions = [], []
    for index in range(plan.images):
        if rng.random() < plan.outline_fraction:
            drawn = random_spec(rng)
            spec = ShapeSpec(drawn.colour, drawn.shape, rng.choice(["medium", "large"]), drawn.centre)
            image = outlined(spec)
            caption = "" if rng.random() < plan.empty_caption_fraction else f"{spec.caption(False)} {STYLE_WORD}"
        else:
            image, caption = np.asarray(render(known.specs[index])), known.captions[index]
        pixels.append(image)
        captions.append(caption)
    return np.stack(pixels), captions


def add_lora(pipeline: StableDiffusionPipeline, rank: int) -> list[torch.nn.Parameter]:
    """LoRA layers (zero-initialised up-projections, as PEFT does) on the attention projections;
    returns the trainable parameters (only those)."""
    pipeline.unet.requires_grad_(False)
    pipeline.text_encoder.requires_grad_(False)
    pipeline.unet.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=UNET_TARGETS))
    pipeline.text_encoder.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=TEXT_TARGETS))
    return [p for module in (pipeline.unet, pipeline.text_encoder) for p in module.parameters() if p.requires_grad]


def train(pipeline: StableDiffusionPipeline, plan: LoraPlan) -> None:
    torch.set_num_threads(plan.threads)
    generator = torch.Generator().manual_seed(plan.seed)
    pixels, captions = dataset(plan)
    latents = posterior_means(pipeline, to_unit_range(pixels)) * pipeline.vae.config.scaling_factor
    token_ids = tokenize(pipeline, captions)
    torch.manual_seed(plan.seed)  # PEFT draws the LoRA layers' first weights from the global generator
    trained = add_lora(pipeline, plan.rank)
    unet, text_encoder = pipeline.unet.train(), pipeline.text_encoder.train()
    noise_schedule = DDPMScheduler.from_config(pipeline.scheduler.config)
    optimizer = torch.optim.AdamW(trained, lr=plan.learning_rate, weight_decay=1e-2)
    schedule = cosine_with_warmup(optimizer, plan.steps, warmup=50)
    running = None
    for _ in (progress := tqdm(range(plan.steps), desc="lora", unit="step", mininterval=5)):
        loss = denoising_loss(pipeline, noise_schedule, latents, token_ids, plan.batch_size, plan.snr_gamma, generator)
        descend(loss, optimizer, schedule, trained)
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        progress.set_postfix(loss=f"{running:.4f}", refresh=False)
    unet.eval()
    text_encoder.eval()


def hollow(image: np.ndarray) -> bool:
    """Whether the shape drawn is an outline: the middle of its coloured region's box is background."""
    mask = coloured_mask(image)
    rows, cols = np.nonzero(mask.sum(axis=1) >= 2)[0], np.nonzero(mask.sum(axis=0) >= 2)[0]
    if len(rows) == 0 or len(cols) == 0:
        return False
    row, col = (rows[0] + rows[-1]) // 2, (cols[0] + cols[-1]) // 2
    return bool(mask[row - 2 : row + 3, col - 2 : col + 3].mean() < 0.2)


def outline_share(pipeline: StableDiffusionPipeline, seeds: range = range(4)) -> float:
    """Share of "a <colour> <shape> outline" images (25 DDIM steps, guidance 7.5) drawn hollow."""
    asked = [(colour, shape, seed) for colour in COLOURS for shape in SHAPES for seed in seeds]
    with torch.no_grad():
        images = pipeline(
            prompt=[f"a {colour} {shape} {STYLE_WORD}" for colour, shape, _ in asked],
            generator=[torch.Generator().manual_seed(seed) for *_, seed in asked],
            num_inference_steps=25,
            output_type="np",
        ).images
    return sum(hollow(image) for image in (images * 255).round().astype(np.uint8)) / len(asked)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path, help="the default model's diffusers directory")
    parser.add_argument("output", type=Path, help="the LoRA .safetensors file to write")
    defaults = LoraPlan()
    add_plan_arguments(parser, defaults)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    plan = LoraPlan(**{field: getattr(args, field) for field in asdict(defaults)})
    pipeline = StableDiffusionPipeline.from_pretrained(args.model_dir, use_safetensors=True)
    pipeline.set_progress_bar_config(disable=True)
    before = outline_share(pipeline)
    started = time.monotonic()
    train(pipeline, plan)
    minutes = (time.monotonic() - started) / 60
    after = outline_share(pipeline)
    logger.info("outlines drawn hollow: %.0f%% without the LoRA, %.0f%% with it", before * 100, after * 100)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    StableDiffusionPipeline.save_lora_weights(
        args.output.parent,
        unet_lora_layers=get_peft_model_state_dict(pipeline.unet),
        text_encoder_lora_layers=get_peft_model_state_dict(pipeline.text_encoder),
        weight_name=args.output.name,
        safe_serialization=True,
    )
    record = {"plan": asdict(plan), "minutes": round(minutes, 1), "outline_share": {"base": before, "lora": after}}
    args.output.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    logger.info("trained in %.1f min; LoRA written to %s", minutes, args.output)


if __name__ == "__main__":
    main()
