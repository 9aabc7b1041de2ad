"""Generate the default model's prompt x seed grid through a real TorchServe, for its model card.

    python -m model_making.render_model_grid --output docs/img/default-model-grid.png

Every image is a request to the served archive (batched by TorchServe as users' requests are);
the colour and shape each image reads as (``model_making.shapes``) are printed and drawn under it.
"""

from __future__ import annotations

import argparse
import io
import logging
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import requests
from matplotlib.figure import Figure
from PIL import Image

from model_making.shapes import COLOURS, SHAPES, Judgement, accuracy, dominant_colour, shape_of
from server import TorchServe, serve_archive
from server.paths import DEFAULT_MODEL_DIR, DOCS_IMG, MODEL_CONFIG

logger = logging.getLogger("render_model_grid")

PROMPTS = [f"a {colour} {shape}" for colour in COLOURS for shape in SHAPES]


def generate(server: TorchServe, prompt: str, seed: int, **fields) -> np.ndarray:
    """One image from the server, as an RGB array."""
    response = requests.post(
        server.predictions_url,
        json={"prompt": prompt, "seed": seed, **fields},
        headers=server.auth(),
        timeout=300,
    )
    response.raise_for_status()
    return np.asarray(Image.open(io.BytesIO(response.content)).convert("RGB"))


def plot_grid(images: dict[tuple[str, int], np.ndarray], seeds: list[int]) -> Figure:
    """Rows are prompts, columns seeds; each image titled with what it reads as."""
    figure, axes = plt.subplots(
        len(PROMPTS), len(seeds), figsize=(1.3 * len(seeds), 1.45 * len(PROMPTS)), squeeze=False
    )
    for row, prompt in enumerate(PROMPTS):
        for column, seed in enumerate(seeds):
            axis, image = axes[row][column], images[(prompt, seed)]
            axis.imshow(image)
            axis.set_xticks([])
            axis.set_yticks([])
            axis.set_title(f"{dominant_colour(image)} {shape_of(image)}", fontsize=6, pad=2)
            if column == 0:
                axis.set_ylabel(prompt, fontsize=7)
    figure.suptitle("Default model through TorchServe: prompt x seed (title: colour and shape read back)", fontsize=8)
    figure.tight_layout()
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--seeds", type=int, default=6, help="columns: seeds 0..N-1")
    parser.add_argument("--output", type=Path, default=DOCS_IMG / "default-model-grid.png")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    seeds = list(range(args.seeds))
    with tempfile.TemporaryDirectory(prefix="model-grid-") as tmp:
        with serve_archive(args.model_dir, MODEL_CONFIG, Path(tmp)) as server:
            asked = [(prompt, seed) for prompt in PROMPTS for seed in seeds]
            with ThreadPoolExecutor(4) as pool:
                images = dict(zip(asked, pool.map(lambda item: generate(server, *item), asked), strict=True))
    judgements = [
        Judgement(prompt.split()[1], prompt.split()[2], seed, dominant_colour(image), shape_of(image))
        for (prompt, seed), image in images.items()
    ]
    logger.info("read back: %s", ", ".join(f"{name} {score:.0%}" for name, score in accuracy(judgements).items()))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    plot_grid(images, seeds).savefig(args.output, dpi=110)
    logger.info("grid written to %s", args.output)


if __name__ == "__main__":
    main()
