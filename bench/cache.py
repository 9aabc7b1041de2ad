"""`make bench-cache`: what step caching per request buys the step engine, side by side.

8 one-image requests (guidance 7.5: 16 rows per forward) generated whole on the step engine, the
same seeds in every workload. DeepCache on the default model (64x64) and on SD 1.5's architecture
(``bench.sd15``, random weights, 256x256):

- no cache;
- all 8 at interval 3 (branch 0);
- half cached: 4 at interval 3, 4 without;
- mixed intervals: 2, 3, 4 and 5, two requests each.

First-block caching on the tiny SD 3.5-shaped model (``models/tiny-sd35``: MMDiT-X blocks, random
weights, 64x64, flow matching), with the share of the cached requests' steps that skipped:

- no cache;
- all 8 at threshold 0.3;
- half cached: 4 at threshold 0.3, 4 without;
- mixed thresholds: 0.1, 0.2, 0.3 and 0.4, two requests each.

Each workload's images/s is timed right after no cache's (paired: the ratio is the median of the
rounds' ratios, so a drift of the machine's speed cancels), with the decode. Beside it, how far
the cached requests' images moved from the same requests without a cache (PSNR, mean over them).

Quality, on the default model: every colour x shape prompt for seeds 0-3 (48 images, 25 DDIM steps,
guidance 7.5) with no cache and at intervals 2, 3 and 5, read back by its colour and shape judges
(``model_making.shapes``, docs/default-model.md), with the PSNR against no cache, and a grid of
the same prompts and seed under each setting (``cache-grid.png``).

With ``--compile``, each model's denoiser is compiled (``handler.compile``, inductor's default
mode): forwards without cached rows run the whole-model graph, forwards with them run the step
cache's regions compiled apart (README, "Step caching"); beside each table, the graphs compiled in
the warm-up round and after it (none is the goal: a bounded few per shape).

Prints the tables and writes ``reports/cache/cache.{json,md,png}`` and ``cache-grid.png``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from bench import sd15  # noqa: E402
from bench.jobs import finish, generate  # noqa: E402
from bench.pipeline import environment, image_distance  # noqa: E402
from bench.report import number_text, publish  # noqa: E402
from handler.adapters.lora_slots import compiled_graphs  # noqa: E402
from handler.config import HandlerSettings, SchedulerName, StepCache  # noqa: E402
from handler.engine.jobs import JobSpec  # noqa: E402
from handler.engine.loading import load_engine, synchronize  # noqa: E402
from handler.engine.step_engine import StepEngine  # noqa: E402
from model_making.shapes import COLOURS, SHAPES, Judgement, accuracy, dominant_colour, shape_of  # noqa: E402
from server.paths import DEFAULT_MODEL_DIR, REPORTS, TINY_MODEL_DIRS  # noqa: E402

logger = logging.getLogger("bench-cache")

NONE = "no cache"
REQUESTS = 8
# The CPU goals on SD 1.5's architecture: images/s against no cache.
GOALS = {"all 8 at interval 3": 2.0, "half cached": 1.35}


def deep(interval: int) -> StepCache:
    return StepCache(mode="deep", interval=interval, branch=0)


def first_block(threshold: float) -> StepCache:
    return StepCache(mode="first_block", threshold=threshold)


Workloads = dict[str, list[StepCache | None]]
WORKLOADS: Workloads = {
    NONE: [None] * REQUESTS,
    "all 8 at interval 3": [deep(3)] * REQUESTS,
    "half cached": [deep(3)] * 4 + [None] * 4,
    "mixed intervals": [deep(interval) for interval in (2, 3, 4, 5) for _ in range(2)],
}
FIRST_BLOCK_WORKLOADS: Workloads = {
    NONE: [None] * REQUESTS,
    "all 8 at threshold 0.3": [first_block(0.3)] * REQUESTS,
    "half cached": [first_block(0.3)] * 4 + [None] * 4,
    "mixed thresholds": [first_block(threshold) for threshold in (0.1, 0.2, 0.3, 0.4) for _ in range(2)],
}


@dataclass(frozen=True)
class Model:
    name: str
    model_dir: Path | None  # None: SD 1.5's architecture, written once
    side: int
    steps: int
    scheduler: SchedulerName = "ddim"
    workloads: Workloads = field(default_factory=lambda: WORKLOADS)


MODELS = {
    "default": Model("default", DEFAULT_MODEL_DIR, 64, 25),
    "sd15": Model("sd15", None, 256, 10),
    "sd35-tiny": Model("sd35-tiny", TINY_MODEL_DIRS["sd35"], 64, 25, "flow_match_euler", FIRST_BLOCK_WORKLOADS),
}


def specs(model: Model, steps: int, caches: list[StepCache | None]) -> list[JobSpec]:
    return [
        JobSpec(f"a red circle {i}", None, (i,), model.side, model.side, steps, model.scheduler, 7.5, cache=cache)
        for i, cache in enumerate(caches)
    ]


@dataclass(frozen=True)
class Timed:
    seconds: float  # to generate the jobs whole: start, every step, decode
    images: list[np.ndarray]
    cached_steps: int  # steps of the cached jobs that reused their cache
    steps: int  # steps of the cached jobs


def timed(engine: StepEngine, specs: list[JobSpec]) -> Timed:
    started = time.perf_counter()
    jobs = engine.start(specs)
    decoded, _ = finish(engine, jobs)
    synchronize(engine.device)
    seconds = time.perf_counter() - started
    cached = [job for job in jobs if job.cache is not None]
    return Timed(
        seconds,
        [np.asarray(result.images[0]) for result in decoded],
        sum(job.cached_steps for job in cached),
        sum(job.total_steps for job in cached),
    )


def measure(model: Model, steps: int, repeats: int, compiled: bool = False) -> dict:
    """Images/s per workload, paired with no cache's, on one model (``compiled``: its denoiser
    compiled, with the graphs compiled in the warm-up round and after it)."""
    model_dir = model.model_dir or sd15.ensure_model()
    compile_settings = {"enabled": True, "targets": ["unet"]} if compiled else {}
    settings = HandlerSettings.model_validate({"model_path": str(model_dir), "compile": compile_settings})
    engine = load_engine(settings, "/unused")
    graphs = [compiled_graphs()]
    seconds: dict[str, list[float]] = {name: [] for name in model.workloads}
    ratios: dict[str, list[float]] = {name: [] for name in model.workloads if name != NONE}
    runs: dict[str, Timed] = {}
    for round_ in range(repeats + 1):  # the first round warms up
        for name, caches in model.workloads.items():
            if name == NONE:
                continue
            runs[NONE] = timed(engine, specs(model, steps, model.workloads[NONE]))
            runs[name] = timed(engine, specs(model, steps, caches))
            if round_:
                seconds[NONE].append(runs[NONE].seconds)
                seconds[name].append(runs[name].seconds)
                ratios[name].append(runs[NONE].seconds / runs[name].seconds)
            logger.info(
                "%s round %d of %d: %s %.2fx",
                model.name,
                round_,
                repeats,
                name,
                runs[NONE].seconds / runs[name].seconds,
            )
        graphs.append(compiled_graphs())
    rows = []
    for name, caches in model.workloads.items():
        cached = [index for index, cache in enumerate(caches) if cache is not None]
        psnrs = [image_distance(runs[name].images[index], runs[NONE].images[index])["psnr_db"] for index in cached]
        rows.append(
            {
                "workload": name,
                "median_s": statistics.median(seconds[name]),
                "images_per_s": REQUESTS / statistics.median(seconds[name]),
                "ratio": 1.0 if name == NONE else statistics.median(ratios[name]),
                "psnr_db": statistics.mean(p for p in psnrs if p is not None) if any(psnrs) else None,
                "cached_share": runs[name].cached_steps / runs[name].steps if cached else None,
            }
        )
    return {
        "model": model.name + (" compiled" if compiled else ""),
        "graphs_warm_up_round": graphs[1] - graphs[0] if compiled else None,
        "graphs_after_it": graphs[-1] - graphs[1] if compiled else None,
        "side": model.side,
        "steps": steps,
        "scheduler": model.scheduler,
        "repeats": repeats,
        "environment": environment(engine.device),
        "rows": rows,
    }


QUALITY_INTERVALS = (None, 2, 3, 5)  # None: no cache
QUALITY_SEEDS = range(4)


def _setting(interval: int | None) -> str:
    return NONE if interval is None else f"interval {interval}"


def quality(steps: int = 25) -> tuple[dict, dict[str, list[np.ndarray]]]:
    """The default model's colour and shape judges, and the PSNR against no cache, per interval;
    with the images (prompt-major, seeds inner) per setting."""
    engine = load_engine(HandlerSettings(model_path=str(DEFAULT_MODEL_DIR)), "/unused")
    asked = [(colour, shape, seed) for colour in COLOURS for shape in SHAPES for seed in QUALITY_SEEDS]
    images: dict[str, list[np.ndarray]] = {}
    rows = []
    for interval in QUALITY_INTERVALS:
        cache = None if interval is None else deep(interval)
        jobs = [JobSpec(f"a {c} {s}", None, (seed,), 64, 64, steps, "ddim", 7.5, cache=cache) for c, s, seed in asked]
        name = _setting(interval)
        images[name] = [
            np.asarray(result.images[0])
            for start in range(0, len(jobs), REQUESTS)
            for result in generate(engine, jobs[start : start + REQUESTS])[0]
        ]
        judged = [
            Judgement(c, s, seed, dominant_colour(p), shape_of(p))
            for (c, s, seed), p in zip(asked, images[name], strict=True)
        ]
        scores = accuracy(judged)
        psnrs = [image_distance(p, q)["psnr_db"] for p, q in zip(images[name], images[NONE], strict=True)]
        finite = [value for value in psnrs if value is not None]
        rows.append(
            {
                "setting": name,
                "colour": scores["colour"],
                "shape": scores["shape"],
                "psnr_db": statistics.mean(finite) if finite else None,
            }
        )
        logger.info("quality %s: colour %.0f%%, shape %.0f%%", name, 100 * scores["colour"], 100 * scores["shape"])
    return {"model": "default", "steps": steps, "images": len(asked), "rows": rows}, images


def quality_table(result: dict) -> str:
    lines = [
        f"\nQuality on the default model ({result['images']} images: every colour x shape prompt, seeds 0-3, "
        f"{result['steps']} DDIM steps, guidance 7.5; its judges, docs/default-model.md):\n",
        "| setting | on colour | right shape | PSNR against no cache (dB) |",
        "| --- | --- | --- | --- |",
    ]
    for row in result["rows"]:
        psnr = number_text(row["psnr_db"], 1)
        lines.append(f"| {row['setting']} | {100 * row['colour']:.0f}% | {100 * row['shape']:.0f}% | {psnr} |")
    return "\n".join(lines) + "\n"


def grid(images: dict[str, list[np.ndarray]], path: Path) -> None:
    """One row per setting, one column per colour x shape prompt (seed 0)."""
    columns = [f"a {c} {s}" for c in COLOURS for s in SHAPES]
    figure, axes = plt.subplots(len(images), len(columns), figsize=(len(columns) * 0.9, len(images) * 1.05))
    for row, (name, pictures) in enumerate(images.items()):
        for column, prompt in enumerate(columns):
            axis = axes[row][column]
            axis.imshow(pictures[column * len(QUALITY_SEEDS)])
            axis.set_xticks([])
            axis.set_yticks([])
            if row == 0:
                axis.set_title(prompt.removeprefix("a "), fontsize=6)
            if column == 0:
                axis.set_ylabel(name, fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def table(results: list[dict]) -> str:
    lines = []
    for result in results:
        graphs = (
            ""
            if result.get("graphs_warm_up_round") is None
            else f"; graphs compiled: {result['graphs_warm_up_round']} in the warm-up round, "
            f"{result['graphs_after_it']} after it"
        )
        lines += [
            f"\n{result['model']} ({result['side']}x{result['side']}, {result['steps']} {result['scheduler']} steps, "
            f"guidance 7.5, {REQUESTS} one-image requests generated whole; median of {result['repeats']} paired "
            f"rounds{graphs}):\n",
            "| workload | images/s | against no cache | cached requests' steps that reused the cache "
            "| PSNR of the cached images against no cache (dB) |",
            "| --- | --- | --- | --- | --- |",
        ]
        for row in result["rows"]:
            psnr, share = number_text(row["psnr_db"], 1), row["cached_share"]
            reused = "" if share is None else f"{100 * share:.0f}%"
            lines.append(f"| {row['workload']} | {row['images_per_s']:.3g} | {row['ratio']:.2f}x | {reused} | {psnr} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> None:
    """Per model, each workload's images/s against no cache, with the CPU goals on SD 1.5's architecture."""
    figure, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for axis, result in zip(axes[0], results, strict=True):
        rows = [row for row in result["rows"] if row["workload"] != NONE]
        names = [row["workload"] for row in rows]
        axis.bar(range(len(rows)), [row["ratio"] for row in rows], color="tab:blue")
        axis.axhline(1.0, color="black", linewidth=0.8)
        if result["model"] == "sd15":
            for index, name in enumerate(names):
                if name in GOALS:
                    axis.hlines(GOALS[name], index - 0.4, index + 0.4, color="red", linestyle="--", label="goal")
        axis.set_xticks(range(len(rows)), [name.replace(" at ", "\nat ") for name in names], fontsize=8)
        axis.set_ylabel("images/s against no cache")
        axis.set_title(f"{result['model']} {result['side']}x{result['side']}, {result['steps']} steps")
        if result["model"] == "sd15":
            handles, labels = axis.get_legend_handles_labels()
            axis.legend(handles[:1], labels[:1], fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument(
        "--steps", type=int, default=None, help="denoising steps per request (default 25, SD 1.5: 10, SD 3.5 tiny: 25)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=REPORTS / "cache")
    parser.add_argument("--no-quality", action="store_true", help="leave out the default model's quality check")
    parser.add_argument(
        "--compile", action="store_true", help="compile each model's denoiser (the step caches' regions compiled apart)"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    results = [
        measure(MODELS[name], args.steps or MODELS[name].steps, args.repeats, args.compile) for name in args.models
    ]
    data: dict = {"results": results}
    text = table(results)
    if not args.no_quality:
        data["quality"], images = quality()
        text += quality_table(data["quality"])
        args.output.mkdir(parents=True, exist_ok=True)
        grid(images, args.output / "cache-grid.png")
    publish(data, text, lambda path: plot(results, path), args.output, "cache")


if __name__ == "__main__":
    main()
