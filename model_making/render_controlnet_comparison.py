"""The default model without and with its shapes-mask ControlNet, beside the control maps, through a
real TorchServe.

    python -m model_making.render_controlnet_comparison --output docs/img/shapes-mask-controlnet.png

Each held-out picture's caption (``model_making.train_controlnet.held_out``: masks the training
never saw) is sent twice with the same seed: plain, and with ``"controlnets": [{"name":
"shapes-mask", "image": <its mask>}]``, to the served archive with ``controlnets/`` as its ControlNet
directory. The mean overlap (intersection over union) of the drawn shape with its mask is printed
and drawn in the title: how well the pictures follow their maps.
"""

from __future__ import annotations

import argparse
import base64
import io
import logging
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from PIL import Image

from model_making.render_model_grid import generate
from model_making.train_controlnet import NAME, held_out, mask_map, overlap
from server import serve_archive, write_model_config
from server.paths import CONTROLNET_DIR, DEFAULT_MODEL_DIR, DOCS_IMG

logger = logging.getLogger("render_controlnet_comparison")

COLUMNS = ("map", "base", "ControlNet")  # a row's images; the map is titled with its caption


def png_base64(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def plot(rows: list[tuple[str, list[np.ndarray]]], overlaps: dict[str, float]) -> Figure:
    """One row per picture: its map, the base model's image and the controlled one."""
    columns = len(rows) // 2
    figure, axes = plt.subplots(2, 3 * columns, figsize=(1.2 * 3 * columns, 3.0), squeeze=False)
    for index, (caption, images) in enumerate(rows):
        for offset, image in enumerate(images):
            axis = axes[index // columns][(index % columns) * 3 + offset]
            axis.imshow(image)
            axis.set_xticks([])
            axis.set_yticks([])
            axis.set_title(caption.removeprefix("a ") if offset == 0 else COLUMNS[offset], fontsize=6)
    figure.suptitle(
        "map | base | ControlNet, through TorchServe; overlap of drawn shape and map: "
        + ", ".join(f"{value:.2f} {name}" for name, value in overlaps.items()),
        fontsize=8,
    )
    figure.tight_layout()
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pictures", type=int, default=8, help="pictures shown (even); 48 are scored")
    parser.add_argument("--output", type=Path, default=DOCS_IMG / "shapes-mask-controlnet.png")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    specs = held_out(0, 48)
    maps = [mask_map(spec) for spec in specs]
    with tempfile.TemporaryDirectory(prefix="controlnet-comparison-") as tmp:
        config = write_model_config(Path(tmp), handler={"controlnets": {"dir": str(CONTROLNET_DIR)}})
        with serve_archive(DEFAULT_MODEL_DIR, config, Path(tmp)) as server:

            def both(index: int) -> tuple[np.ndarray, np.ndarray]:
                caption, control = specs[index].caption(with_size=False), png_base64(maps[index])
                plain = generate(server, caption, index)
                controlled = generate(server, caption, index, controlnets=[{"name": NAME, "image": control}])
                return plain, controlled

            with ThreadPoolExecutor(4) as pool:
                made = list(pool.map(both, range(len(specs))))
    overlaps = {
        "base model": float(np.mean([overlap(plain, mask) for (plain, _), mask in zip(made, maps, strict=True)])),
        "ControlNet": float(np.mean([overlap(ruled, mask) for (_, ruled), mask in zip(made, maps, strict=True)])),
    }
    for name, value in overlaps.items():
        logger.info("%s: mean overlap of the drawn shape with its map %.2f", name, value)
    rows = [
        (specs[index].caption(with_size=False), [np.asarray(maps[index]), *made[index]])
        for index in range(args.pictures)
    ]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    plot(rows, overlaps).savefig(args.output, dpi=110)
    logger.info("comparison written to %s", args.output)


if __name__ == "__main__":
    main()
