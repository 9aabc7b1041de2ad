"""`make bench-engine`: the step engine's own cost against the diffusers call it mirrors.

The same requests (one image each: prompt k, seed k) go through diffusers' own pipeline call (one
batched call, ``bench.reference``) and through the step engine as the service runs a batch
(``bench.jobs``: every job in each denoiser forward, one decode), per family, at batch 1 and 8, in
one process, the order alternating per repeat: the default model (SD 1.x) and the tiny SD 2.x,
SDXL, SD 3 and SD 3.5 Medium-shaped models at their native sizes; then SD 3.5 Medium's real
architecture (``bench.sd35``, random weights, without T5 to fit a 24 GiB machine) at 256x256,
batch 1, two steps (``--quick`` leaves it out). Prints median seconds per call, the ratio and the
image distance, next to the distance between diffusers' own batched call and the same requests
alone (what float rounding alone moves; large for a random-weight model that amplifies it over
many steps), and writes ``reports/engine/engine.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch

from bench import sd35
from bench.jobs import generate
from bench.measure import PROMPTS
from bench.pipeline import environment
from bench.reference import Reference
from bench.report import markdown_table, publish
from handler.config import HandlerSettings
from handler.engine.jobs import JobSpec
from handler.engine.loading import load_engine, resolve_device, synchronize
from handler.engine.step_engine import StepEngine
from server.paths import DEFAULT_MODEL_DIR, REPORTS, TINY_MODEL_DIRS

logger = logging.getLogger("bench-engine")

FAMILY_MODELS = {
    "sd1": DEFAULT_MODEL_DIR,
    **{family: TINY_MODEL_DIRS[family] for family in ("sd2", "sdxl", "sd3", "sd35")},
}
GOAL = 1.05  # the engine within 5% of the diffusers call


@dataclass(frozen=True)
class Architecture:
    """A published architecture with random weights, measured at a size and batch this CPU affords."""

    model_dir: Callable[[], Path]  # writes it once
    side: int
    batches: tuple[int, ...]
    steps: int
    repeats: int


ARCHITECTURES = {
    "sd35-medium": Architecture(sd35.ensure_model_without_t5, 256, (1,), steps=2, repeats=2),
}


# The engine's denoiser: eager, inductor's kernels in CUDA graphs, or eager's kernels in CUDA graphs.
DENOISERS: dict[str, dict] = {
    "eager": {},
    "compile-reduce-overhead": {"enabled": True, "mode": "reduce-overhead", "targets": ["unet"]},
    "cudagraphs": {"enabled": True, "backend": "cudagraphs", "targets": ["unet"]},
}


@dataclass(frozen=True)
class Row:
    family: str
    model: str
    batch: int
    side: int
    steps: int
    diffusers_s: float
    engine_s: float
    max_abs_diff: int
    diffusers_batch_diff: int  # diffusers' batched call against each request alone: the rounding floor
    denoiser: str = "eager"  # the engine's denoiser, of DENOISERS (a compiled one's forwards padded to its graphs)

    @property
    def engine_it_s(self) -> float:
        """Denoising steps per second through the step engine (decode included in its time)."""
        return self.steps / self.engine_s

    @property
    def ratio(self) -> float:
        return self.engine_s / self.diffusers_s


def timed(call, device: torch.device) -> float:
    started = time.perf_counter()
    call()
    synchronize(device)
    return time.perf_counter() - started


def compare(
    family: str,
    reference: Reference,
    engine: StepEngine,
    batch: int,
    steps: int,
    repeats: int,
    side: int,
    denoiser: str = "eager",
) -> Row:
    """Median seconds of the same ``batch`` one-image requests through both, alternating who goes
    first, with the model's own scheduler."""
    scheduler = engine.family.own_scheduler
    specs = [
        JobSpec(PROMPTS[index % len(PROMPTS)], None, (index,), side, side, steps, scheduler, 7.5)
        for index in range(batch)
    ]
    prompts, seeds = [spec.prompt for spec in specs], [spec.seeds[0] for spec in specs]

    def by_diffusers():
        return reference.batch(prompts, seeds, side, side, steps, scheduler).images

    def by_engine():
        return [image for decoded in generate(engine, specs)[0] for image in decoded.images]

    ours, theirs = by_engine(), by_diffusers()  # warm-up, and the images compared
    alone = [
        reference.batch([prompt], [seed], side, side, steps, scheduler).images[0]
        for prompt, seed in zip(prompts, seeds, strict=True)
    ]
    diffusers_s, engine_s = [], []
    for repeat in range(repeats):
        order = ((by_diffusers, diffusers_s), (by_engine, engine_s))
        for call, seconds in order if repeat % 2 == 0 else order[::-1]:
            seconds.append(timed(call, engine.device))
    return Row(
        family,
        Path(reference.model_dir).name,
        batch,
        side,
        steps,
        statistics.median(diffusers_s),
        statistics.median(engine_s),
        max_difference(ours, theirs),
        max_difference(theirs, alone),
        denoiser,
    )


def max_difference(images: list, others: list) -> int:
    """The largest 8-bit difference between corresponding images."""
    return max(
        int(np.abs(np.asarray(a, dtype=np.int16) - np.asarray(b, dtype=np.int16)).max())
        for a, b in zip(images, others, strict=True)
    )


def table(rows: list[Row]) -> str:
    header = [
        "family", "model", "batch", "size", "steps", "diffusers call (s)", "step engine (s)", "engine / diffusers",
        "max pixel diff, engine vs diffusers", "max pixel diff, diffusers batched vs alone", "engine's denoiser",
    ]  # fmt: skip
    return markdown_table(
        header,
        [
            [
                row.family,
                row.model,
                str(row.batch),
                f"{row.side}x{row.side}",
                str(row.steps),
                f"{row.diffusers_s:.4f}",
                f"{row.engine_s:.4f}",
                f"{row.ratio:.3f}x",
                str(row.max_abs_diff),
                str(row.diffusers_batch_diff),
                row.denoiser,
            ]  # fmt: skip
            for row in rows
        ],
    )


def markdown(rows: list[Row], env: dict) -> str:
    return f"{env['device_name']}, torch {env['torch']}, diffusers {env['diffusers']}, {env['date']}\n\n" + table(rows)


def measure_model(
    family: str,
    model_dir: Path,
    device: str,
    batches: list[int],
    steps: int,
    repeats: int,
    side: int | None = None,
    shared: bool = False,
    denoiser: str = "eager",
) -> list[Row]:
    """The engine against diffusers' call on one model (``family`` "custom": detected), per batch,
    at ``side`` (None: the model's native size). ``shared``: diffusers calls the pipeline the engine
    loaded instead of loading its own (for a model too large to hold twice; the engine leaves it as
    diffusers loads it but for the attention processors, which are diffusers' defaults).
    ``denoiser``: the engine's, one of ``DENOISERS`` (a compiled one's forwards padded to its graphs'
    row counts where it replays CUDA graphs), against diffusers' eager call."""
    compiled = {"compile": DENOISERS[denoiser]} if DENOISERS[denoiser] else {}
    settings = HandlerSettings.model_validate(
        {"model_path": str(Path(model_dir).resolve()), "device": device, **compiled}
    )
    engine = load_engine(settings, ".")
    reference = Reference(model_dir, engine.device, engine.dtype, pipeline=engine.pipeline if shared else None)
    side = side or engine.family.native_size()[0]
    rows = []
    for batch in batches:
        name = engine.family.name if family == "custom" else family
        row = compare(name, reference, engine, batch, steps, repeats, side, denoiser)
        logger.info(
            "%s batch %d: diffusers %.4f s, engine %.4f s, %.3fx, max pixel diff %d (diffusers batched vs alone %d)",
            row.family,
            batch,
            row.diffusers_s,
            row.engine_s,
            row.ratio,
            row.max_abs_diff,
            row.diffusers_batch_diff,
        )
        rows.append(row)
    return rows


def plot(rows: list[Row], path: Path) -> None:
    figure, axis = plt.subplots(figsize=(max(8, 1.1 * len(rows)), 4))
    labels = [f"{row.family}\nbatch {row.batch}" for row in rows]
    axis.bar(
        labels, [row.ratio for row in rows], color=["tab:green" if row.ratio <= GOAL else "tab:red" for row in rows]
    )
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.axhline(GOAL, color="tab:red", linestyle="--", label=f"goal: within {GOAL - 1:.0%}")
    axis.set_ylabel("step engine / diffusers call (time)")
    axis.tick_params(axis="x", labelsize=8)
    axis.set_ylim(0.8, max(1.2, max(row.ratio for row in rows) + 0.05))
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", default=list(FAMILY_MODELS), choices=list(FAMILY_MODELS))
    parser.add_argument(
        "--model-dir", type=Path, help="measure this diffusers directory instead (its family is detected)"
    )
    parser.add_argument("--batches", nargs="*", type=int, default=[1, 8])
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"])
    parser.add_argument(
        "--architectures",
        nargs="*",
        default=list(ARCHITECTURES),
        choices=list(ARCHITECTURES),
        help="measured after the families",
    )
    parser.add_argument(
        "--quick", action="store_true", help="CI mode: 2 steps, 1 repeat, batches 1 and 2, no architectures"
    )
    parser.add_argument("--output-dir", type=Path, default=REPORTS / "engine")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats, args.batches, args.architectures = 2, 1, [1, 2], []
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    device = resolve_device(args.device)
    models = (
        {"custom": args.model_dir} if args.model_dir else {family: FAMILY_MODELS[family] for family in args.families}
    )
    rows = [
        row
        for family, model_dir in models.items()
        for row in measure_model(family, model_dir, args.device, args.batches, args.steps, args.repeats)
    ]
    for name in [] if args.model_dir else args.architectures:
        gc.collect()  # the previous model's pipelines go before a large one loads
        architecture = ARCHITECTURES[name]
        rows += measure_model(
            name,
            architecture.model_dir(),
            args.device,
            list(architecture.batches),
            architecture.steps,
            architecture.repeats,
            architecture.side,
            shared=True,
        )
    env = environment(device)
    figures = {"environment": env, "goal_ratio": GOAL, "rows": [{**asdict(row), "ratio": row.ratio} for row in rows]}
    publish(figures, markdown(rows, env), lambda path: plot(rows, path), args.output_dir, "engine")


if __name__ == "__main__":
    main()
