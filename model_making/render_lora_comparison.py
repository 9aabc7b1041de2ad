"""The default model without and with its outline LoRA, side by side, through a real TorchServe.

    python -m model_making.render_lora_comparison --output docs/img/outline-lora.png

Each prompt "a <colour> <shape> outline" is sent twice per seed, once plain and once with
``"loras": [{"name": "outline"}]``, to the served archive with ``loras/`` as its LoRA directory;
the share of images drawn hollow (``model_making.train_lora.hollow``) is printed and drawn in the
titles.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from model_making.render_model_grid import generate
from model_making.shapes import COLOURS, SHAPES
from model_making.train_lora import STYLE_WORD, hollow
from server import serve_archive, write_model_config
from server.paths import DEFAULT_MODEL_DIR, DOCS_IMG, ROOT

logger = logging.getLogger("render_lora_comparison")

PROMPTS = [f"a {colour} {shape} {STYLE_WORD}" for colour in COLOURS for shape in SHAPES]
VARIANTS = {"base model": [], "with the outline LoRA": [{"name": "outline"}]}


def hollow_shares(images: dict[tuple[str, str, int], np.ndarray]) -> dict[str, float]:
    """Per variant, the share of its images drawn hollow."""
    return {
        variant: float(np.mean([hollow(image) for (_, name, _), image in images.items() if name == variant]))
        for variant in VARIANTS
    }


def plot(images: dict[tuple[str, str, int], np.ndarray], seeds: list[int], shares: dict[str, float]) -> Figure:
    """Rows are prompts; for each seed a base column and a LoRA column."""
    columns = [(variant, seed) for seed in seeds for variant in VARIANTS]
    figure, axes = plt.subplots(
        len(PROMPTS), len(columns), figsize=(1.2 * len(columns), 1.3 * len(PROMPTS)), squeeze=False
    )
    for row, prompt in enumerate(PROMPTS):
        for column, (variant, seed) in enumerate(columns):
            axis = axes[row][column]
            axis.imshow(images[(prompt, variant, seed)])
            axis.set_xticks([])
            axis.set_yticks([])
            if row == 0:
                axis.set_title(f"{'LoRA' if VARIANTS[variant] else 'base'}, seed {seed}", fontsize=6, pad=2)
            if column == 0:
                axis.set_ylabel(prompt.removesuffix(f" {STYLE_WORD}"), fontsize=7)
    figure.suptitle(
        f'"... {STYLE_WORD}" through TorchServe: drawn hollow '
        + ", ".join(f"{share:.0%} {variant}" for variant, share in shares.items()),
        fontsize=8,
    )
    figure.tight_layout()
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--output", type=Path, default=DOCS_IMG / "outline-lora.png")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    seeds = list(range(args.seeds))
    with tempfile.TemporaryDirectory(prefix="lora-comparison-") as tmp:
        config = write_model_config(Path(tmp), handler={"loras": {"dir": str(ROOT / "loras")}})
        with serve_archive(DEFAULT_MODEL_DIR, config, Path(tmp)) as server:
            asked = [(prompt, variant, seed) for prompt in PROMPTS for variant in VARIANTS for seed in seeds]
            with ThreadPoolExecutor(4) as pool:
                made = pool.map(lambda item: generate(server, item[0], item[2], loras=VARIANTS[item[1]]), asked)
                images = dict(zip(asked, made, strict=True))
    shares = hollow_shares(images)
    for variant, share in shares.items():
        logger.info("%s: %.0f%% of the outline prompts drawn hollow", variant, share * 100)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    plot(images, seeds, shares).savefig(args.output, dpi=110)
    logger.info("comparison written to %s", args.output)


if __name__ == "__main__":
    main()
