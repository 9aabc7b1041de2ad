"""`make bench-single-file`: a single-file checkpoint at a real architecture's size against its
diffusers directory: load time side by side, and the same weights and images.

SD 1.5's architecture with random weights (``bench.sd15``, float16) is written once as an A1111
single file (LDM key layout, ``model_making.single_file``) and loaded with the shipped configs and
CLIP tokenizer, nothing else given; its directory is loaded as the handler loads any. Loads
alternate, file then directory, ``--repeats`` times (the first of each warms the page cache and is
left out). Then every weight of the file's pipeline is checked against the directory's, and one
request (two steps, 64x64) generated from each (the directory's pipeline given the shipped CLIP
tokenizers and their end-of-text id, since its own are byte-level) must give the same image; one
model is in memory at a time. ``--models sd15 sdxl`` does the same for SDXL base's architecture too
(``bench.sdxl``, about 7 GB).

Prints the table and writes ``reports/single-file/single-file.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench import sd15, sdxl  # noqa: E402
from bench.pipeline import environment  # noqa: E402
from bench.report import markdown_table, number_text, publish  # noqa: E402
from handler.checkpoints.tokenizers import clip_tokenizer  # noqa: E402
from handler.config import HandlerSettings  # noqa: E402
from handler.engine.jobs import JobSpec  # noqa: E402
from handler.engine.loading import load_engine  # noqa: E402
from handler.engine.step_engine import StepEngine  # noqa: E402
from model_making.single_file import write_single_file  # noqa: E402
from server.paths import MODELS, REPORTS  # noqa: E402

logger = logging.getLogger("bench-single-file")

MODELS_BUILT: dict[str, Callable[[], Path]] = {"sd15": sd15.ensure_model, "sdxl": sdxl.ensure_model}
JOB = JobSpec("a red circle", None, (0,), 64, 64, 2, "ddim", 7.5, None, None, 1.0, (), (), None)


def engine(source: Path) -> tuple[StepEngine, float]:
    """The engine over ``source`` as a worker loads it (float32 on this CPU), and the seconds it took."""
    started = time.perf_counter()
    loaded = load_engine(HandlerSettings(model_path=str(source), device="cpu"), "/unused")
    return loaded, time.perf_counter() - started


def image(loaded: StepEngine) -> np.ndarray:
    (job,) = loaded.start([JOB])
    while not job.done:
        loaded.step([job])
    return np.asarray(loaded.decode(job.latents, JOB.width, JOB.height).images[0])


def fingerprint(loaded: StepEngine, shipped_tokenizers: bool = False) -> tuple[dict[str, str], np.ndarray]:
    """A digest of every weight of the engine's pipeline and its image of ``JOB``, the engine freed
    after (one model in memory at a time: SDXL's is 14 GB in float32); ``shipped_tokenizers``: the
    shipped CLIP tokenizers first, and their end-of-text id where the text encoders pool (a
    directory's own tokenizers are byte-level, of other ids)."""
    pipeline = loaded.pipeline
    digests = {
        f"{component}.{key}": hashlib.sha256(
            value.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        ).hexdigest()
        for component in ("unet", "vae", "text_encoder", "text_encoder_2")
        if getattr(pipeline, component, None) is not None
        for key, value in getattr(pipeline, component).state_dict().items()
    }
    if shipped_tokenizers:
        _shipped_tokenizers(pipeline)
    picture = image(loaded)
    del loaded, pipeline
    gc.collect()
    return digests, picture


def _shipped_tokenizers(pipeline: Any) -> None:
    """The shipped CLIP tokenizers in ``pipeline``, and their end-of-text id where its text encoders
    pool (SDXL's pooled embedding is read at that token)."""
    pipeline.tokenizer = clip_tokenizer()
    if getattr(pipeline, "tokenizer_2", None) is not None:
        pipeline.tokenizer_2 = clip_tokenizer("!")
    for index in ("", "_2"):
        tokenizer = getattr(pipeline, f"tokenizer{index}", None)
        encoder = getattr(pipeline, f"text_encoder{index}", None)
        for module in encoder.modules() if encoder is not None else ():
            if hasattr(module, "eos_token_id"):
                module.eos_token_id = tokenizer.eos_token_id


def compare(model: str, repeats: int) -> dict:
    """Load times of the single file and the directory, and whether weights and image agree."""
    directory = MODELS_BUILT[model]()
    single = MODELS / f"{directory.name}.safetensors"
    if not single.is_file() or single.stat().st_mtime < (directory / "random-weights.json").stat().st_mtime:
        logger.info("writing %s", single)
        write_single_file(engine(directory)[0].pipeline.to(torch.float16), single)
    times: dict[str, list[float]] = {"single file": [], "directory": []}
    for round_ in range(repeats + 1):
        for name, source in (("single file", single), ("directory", directory)):
            loaded, seconds = engine(source)
            logger.info("%s round %d: %s loaded in %.1f s", model, round_, name, seconds)
            if round_:
                times[name].append(seconds)
            del loaded
            gc.collect()  # the last engine's weights freed before the next load is timed
    file_weights, file_image = fingerprint(engine(single)[0])
    directory_weights, directory_image = fingerprint(engine(directory)[0], shipped_tokenizers=True)
    differing = [key for key, digest in directory_weights.items() if file_weights.get(key) != digest]
    difference = int(np.abs(file_image.astype(int) - directory_image.astype(int)).max())
    file_s, directory_s = statistics.median(times["single file"]), statistics.median(times["directory"])
    return {
        "model": model,
        "file_bytes": single.stat().st_size,
        "single_file_s": file_s,
        "directory_s": directory_s,
        "ratio": file_s / directory_s,
        "weights_differing": differing[:5],
        "image_max_difference": difference,
    }


def table(rows: list[dict], env: dict) -> str:
    header = [
        "model",
        "file GB",
        "single file s",
        "directory s",
        "file / directory",
        "weights differing",
        "image max diff",
    ]
    cells = [
        [
            row["model"],
            f"{row['file_bytes'] / 1e9:.2f}",
            number_text(row["single_file_s"]),
            number_text(row["directory_s"]),
            f"{row['ratio']:.2f}x",
            str(len(row["weights_differing"])),
            str(row["image_max_difference"]),
        ]
        for row in rows
    ]
    title = f"Single-file checkpoint against its directory, load to a ready engine ({env['device_name']}, float32)"
    return f"{title}, median of the rounds\n\n" + markdown_table(header, cells)


def plot(rows: list[dict]) -> Callable[[Path], None]:
    def draw(path: Path) -> None:
        figure, axis = plt.subplots(figsize=(6, 3))
        positions = np.arange(len(rows))
        axis.bar(positions - 0.2, [row["single_file_s"] for row in rows], 0.4, label="single file")
        axis.bar(positions + 0.2, [row["directory_s"] for row in rows], 0.4, label="diffusers directory")
        axis.set_xticks(positions, [row["model"] for row in rows])
        axis.set_ylabel("load to a ready engine (s)")
        axis.legend()
        figure.tight_layout()
        figure.savefig(path, dpi=120)
        plt.close(figure)

    return draw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS_BUILT), default=["sd15"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, default=REPORTS / "single-file")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = [compare(model, args.repeats) for model in args.models]
    env = environment(torch.device("cpu"))
    publish({"environment": env, "rows": rows}, table(rows, env), plot(rows), args.output, "single-file")
    failed = [row["model"] for row in rows if row["weights_differing"] or row["image_max_difference"]]
    if failed:
        raise SystemExit(f"the single file differs from its directory: {failed}")


if __name__ == "__main__":
    main()
