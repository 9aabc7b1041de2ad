"""`make bench-compile-rows`: what a compiled denoiser's first compile costs with its rows marked
dynamic (``handler.engine.loading.dynamic_rows``, the worker's default: the whole denoiser's inputs,
and the step cache's regions' arguments) against rows left static until they change (torch's
automatic dynamic shapes: the first count alone, then every count again), and with the rows marked
on the cudagraphs backend (``compile.backend``: dynamo's graph of the eager kernels, no inductor;
the step cache's regions eager).

Per tiny model (random weights, made by ``make model``), per setting, one process with a fresh
inductor cache loads the engine with the denoiser compiled (``compile.targets: [unet]``) and steps
one guided job of 3 images (6 rows), then one of 2 (4 rows), then the same two with the model's
step cache (DeepCache at interval 2, SD 3's first-block cache; two steps: the cached forward runs
the regions compiled apart): the seconds of each and the graphs compiled after each. Per model,
static, marked, then cudagraphs, ``--repeats`` times. Prints the table with the ratios marked /
static and cudagraphs / marked of the median total and writes
``reports/compile_rows/compile_rows.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import matplotlib.pyplot as plt
import torch
from matplotlib.patches import Patch

from bench.jobs import generate
from bench.pipeline import environment, python_module
from bench.report import markdown_table, publish
from handler.adapters.lora_slots import compiled_graphs
from handler.config import HandlerSettings, StepCache
from handler.engine import loading
from handler.engine.jobs import JobSpec
from server.paths import REPORTS, ROOT, TINY_MODEL_DIRS

logger = logging.getLogger("bench.compile_rows")

MODELS = ("sd1", "sdxl", "sd3")
SCHEDULERS = {"sd1": "ddim", "sdxl": "euler", "sd3": "flow_match_euler"}
# Rows left static until they change; rows marked dynamic; marked, on the cudagraphs backend.
SETTINGS = ("static", "marked", "cudagraphs")
# The jobs stepped one after the other, guided: 6 rows, then 4, then the same with a step cache.
JOBS = ((3, False), (2, False), (3, True), (2, True))
# Each step of a job with a step cache runs the denoiser's forward around its regions (compiled apart).
CACHES = {
    "sd1": StepCache(mode="deep", interval=2),
    "sdxl": StepCache(mode="deep", interval=2),
    "sd3": StepCache(mode="first_block", threshold=1.0),
}


def job_name(images: int, cached: bool) -> str:
    return f"{images} images{', cached' if cached else ''}"


def measure_once(family: str, setting: str) -> dict:
    """In this process: the engine's jobs one after the other, each timed, with the graphs compiled."""
    backend = "cudagraphs" if setting == "cudagraphs" else "inductor"
    compiled = {"enabled": True, "targets": ["unet"], "backend": backend}
    settings = {"model_path": str(TINY_MODEL_DIRS[family]), "compile": compiled}
    with mock.patch.object(loading, "dynamic_rows", lambda _: setting != "static"):  # the setting compared
        engine = loading.load_engine(HandlerSettings.model_validate(settings), "/unused")
    jobs = []
    for images, cached in JOBS:
        spec = JobSpec("a red circle", None, tuple(range(images)), 64, 64, 1, SCHEDULERS[family], 7.5)
        if cached:  # two steps: the first full, the second cached
            spec = dataclasses.replace(spec, num_inference_steps=2, cache=CACHES[family])
        started = time.perf_counter()
        generate(engine, [spec])
        jobs.append(
            {"job": job_name(images, cached), "seconds": time.perf_counter() - started, "graphs": compiled_graphs()}
        )
    return {"family": family, "setting": setting, "torch": torch.__version__, "jobs": jobs}


def measure(family: str, setting: str, timeout: float) -> dict:
    """``measure_once`` in a fresh process and inductor cache."""
    with tempfile.TemporaryDirectory(prefix="bench-compile-rows-") as cache:
        env = {"TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": str(ROOT)}
        env["TORCHINDUCTOR_VEC_ISA_OK"] = os.environ.get("TORCHINDUCTOR_VEC_ISA_OK", "0")  # as the suite compiles
        done = python_module("bench.compile_rows", ["--child", family, setting], env, timeout)
    if done.returncode:
        raise RuntimeError(f"{family}, {setting}: exit {done.returncode}\n{done.stdout[-4000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def summary(runs: list[dict]) -> list[dict]:
    """Per model and setting: the median seconds of each job and of all, the graphs after each."""
    rows = []
    for family in dict.fromkeys(run["family"] for run in runs):
        for setting in SETTINGS:
            mine = [run for run in runs if run["family"] == family and run["setting"] == setting]
            if not mine:
                continue
            rows.append(
                {
                    "family": family,
                    "setting": setting,
                    "runs": len(mine),
                    "seconds": [
                        statistics.median(run["jobs"][job]["seconds"] for run in mine) for job in range(len(JOBS))
                    ],
                    "total_s": statistics.median(sum(job["seconds"] for job in run["jobs"]) for run in mine),
                    "graphs": [job["graphs"] for job in mine[0]["jobs"]],
                }
            )
    return rows


def table(rows: list[dict]) -> str:
    totals = {(row["family"], row["setting"]): row["total_s"] for row in rows}
    against = {"marked": "static", "cudagraphs": "marked"}  # each setting's ratio, to the one before it
    header = [
        "model",
        "rows",
        *(f"{job_name(*job)} (s)" for job in JOBS),
        "all (s)",
        "graphs after each",
        "against the one before",
    ]
    cells = [
        [
            row["family"],
            row["setting"],
            *(f"{seconds:.1f}" for seconds in row["seconds"]),
            f"{row['total_s']:.1f}",
            ", ".join(map(str, row["graphs"])),
            f"{row['total_s'] / totals[row['family'], against[row['setting']]]:.2f}x {row['setting']} / "
            f"{against[row['setting']]}"
            if (row["family"], against.get(row["setting"])) in totals
            else "—",
        ]
        for row in rows
    ]
    return markdown_table(header, cells)


def plot(rows: list[dict], path: Path) -> None:
    """Per model, a bar per setting (hatched apart), stacked by job (coloured apart)."""
    families = list(dict.fromkeys(row["family"] for row in rows))
    figure, axis = plt.subplots(figsize=(8, 4))
    width, hatches = 0.8 / len(SETTINGS), ("", "//", "..")
    colours = [f"C{job}" for job in range(len(JOBS))]
    for index, setting in enumerate(SETTINGS):
        mine = {row["family"]: row for row in rows if row["setting"] == setting}
        positions = [position + index * width for position, family in enumerate(families) if family in mine]
        bottoms = [0.0] * len(positions)
        for job in range(len(JOBS)):
            heights = [mine[family]["seconds"][job] for family in families if family in mine]
            axis.bar(positions, heights, width, bottom=bottoms, color=colours[job], hatch=hatches[index], edgecolor="k")
            bottoms = [bottom + height for bottom, height in zip(bottoms, heights, strict=True)]
    handles = [Patch(facecolor=colour, label=job_name(*job)) for colour, job in zip(colours, JOBS, strict=True)]
    handles += [
        Patch(facecolor="white", edgecolor="k", hatch=hatch, label=setting)
        for setting, hatch in zip(SETTINGS, hatches, strict=True)
    ]
    axis.set_xticks([position + width * (len(SETTINGS) - 1) / 2 for position in range(len(families))], families)
    axis.set_ylabel("seconds (compile included)")
    axis.set_title("A compiled denoiser's first row counts, then its step cache's")
    axis.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--output", type=Path, default=REPORTS / "compile_rows")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one measuring process may take")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        family, setting = args.child
        print(json.dumps(measure_once(family, setting)))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    runs = []
    for family in args.models:
        for repeat in range(args.repeats):
            for setting in SETTINGS:
                runs.append(measure(family, setting, args.timeout))
                jobs = runs[-1]["jobs"]
                logger.info(
                    "%s %s (%d/%d): %s",
                    family,
                    setting,
                    repeat + 1,
                    args.repeats,
                    ", ".join(f"{job['job']} {job['seconds']:.1f} s, {job['graphs']} graphs" for job in jobs),
                )
    rows = summary(runs)
    data = {"environment": environment(torch.device("cpu")), "runs": runs, "rows": rows}
    publish(data, table(rows), lambda path: plot(rows, path), args.output, "compile_rows")


if __name__ == "__main__":
    main()
