"""`make bench-schedules`: the host time each scheduler costs a job, a schedule's first job against
the next, side by side in one run.

Per scheduler the default model offers and per step count, two jobs of one image start and run their
whole schedule with random model outputs (no denoiser): the first builds the schedule's template
(``Family.scheduler``; a scheduler's first template also builds the scheduler from the model's config,
``Family._new_scheduler``), the second copies it. Each reports the milliseconds its start took (what
every job in flight waits for in the continuous loop) and its scheduler steps' host milliseconds a
step (on a GPU the host queues the step's work meanwhile: longer than a forward and the device runs
dry). Writes reports/schedules/schedules.{json,md,png}.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from bench.report import markdown_table, publish  # noqa: E402
from handler.config import HandlerSettings, SchedulerName  # noqa: E402
from handler.engine.loading import load_engine  # noqa: E402
from handler.families import Family, schedules  # noqa: E402
from server.paths import DEFAULT_MODEL_DIR, REPORTS  # noqa: E402

logger = logging.getLogger(__name__)

LATENT_SHAPE = (4, 8, 8)
JOBS = ("first", "next")


@dataclass
class ScheduleRun:
    """A job's whole schedule: its last latents, its start's and each scheduler call's host milliseconds."""

    latents: torch.Tensor
    start_ms: float
    step_ms: list[float]


def run_schedule(family: Family, scheduler: SchedulerName, steps: int) -> ScheduleRun:
    """One job of one image started and stepped through its whole schedule with random model outputs
    (no denoiser), each call timed on the host."""
    started = time.perf_counter()
    stepper, host = family.scheduler(scheduler, steps, LATENT_SHAPE)
    family.prepare_scheduler(stepper)
    start_ms = (time.perf_counter() - started) * 1000
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, *LATENT_SHAPE, generator=generator)
    kwargs = family.step_kwargs(stepper, [torch.Generator().manual_seed(1)], 0.0)
    step_ms = []
    for index, timestep in enumerate(stepper.timesteps):
        output = 0.1 * torch.randn(latents.shape, generator=generator)
        started = time.perf_counter()
        latents = schedules.step(stepper, output, timestep, host[index], latents, kwargs)
        step_ms.append((time.perf_counter() - started) * 1000)
    return ScheduleRun(latents, start_ms, step_ms)


def run_job(family: Family, scheduler: SchedulerName, steps: int) -> dict:
    """One job's start's milliseconds and its steps' median and total milliseconds."""
    run = run_schedule(family, scheduler, steps)
    return {
        "start_ms": run.start_ms,
        "step_ms": median(run.step_ms),
        "steps_ms": sum(run.step_ms),
        "calls": len(run.step_ms),
    }


def measure(family: Family, names: list[SchedulerName], step_counts: list[int]) -> list[dict]:
    """Per scheduler and step count, a first job and the next, one after the other."""
    rows = []
    for name in names:
        for steps in step_counts:
            jobs = {job: run_job(family, name, steps) for job in JOBS}
            rows.append({"scheduler": name, "steps": steps, **jobs})
            logger.info(
                "%s, %d steps: start %.1f ms (next job %.1f ms), %.2f ms a step (next job %.2f ms)",
                name,
                steps,
                jobs["first"]["start_ms"],
                jobs["next"]["start_ms"],
                jobs["first"]["step_ms"],
                jobs["next"]["step_ms"],
            )
    return rows


def table(rows: list[dict]) -> str:
    header = [
        "scheduler",
        "steps",
        "calls",
        "first job: start ms",
        "first job: ms a step",
        "first job: all steps ms",
        "next job: start ms",
        "next job: ms a step",
    ]
    return markdown_table(
        header,
        [
            [
                row["scheduler"],
                str(row["steps"]),
                str(row["first"]["calls"]),
                f"{row['first']['start_ms']:.1f}",
                f"{row['first']['step_ms']:.2f}",
                f"{row['first']['steps_ms']:.0f}",
                f"{row['next']['start_ms']:.1f}",
                f"{row['next']['step_ms']:.2f}",
            ]
            for row in rows
        ],
    )


def plot(rows: list[dict], path: Path) -> None:
    """Per step count, a bar per scheduler and job: its start's milliseconds, and below its steps'
    (log scales)."""
    step_counts = list(dict.fromkeys(row["steps"] for row in rows))
    figure, axes = plt.subplots(2, len(step_counts), figsize=(7 * len(step_counts), 8), squeeze=False)
    for column, steps in enumerate(step_counts):
        of_count = [row for row in rows if row["steps"] == steps]
        positions = range(len(of_count))
        for axis, figure_ms, label in (
            (axes[0][column], "start_ms", "a job's start, ms (host)"),
            (axes[1][column], "steps_ms", "its scheduler steps, ms (host)"),
        ):
            for offset, job in zip((-0.2, 0.2), JOBS, strict=True):
                values = [row[job][figure_ms] for row in of_count]
                axis.bar([p + offset for p in positions], values, 0.4, label=job)
            axis.set_xticks(list(positions), [row["scheduler"] for row in of_count], rotation=60, fontsize=7)
            axis.set_yscale("log")
            axis.set_ylabel(label)
            axis.set_title(f"{steps} steps")
            axis.legend(fontsize=8, title="job of the schedule")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--schedulers", nargs="+", default=None, help="default: every one the model offers")
    parser.add_argument("--steps", nargs="+", type=int, default=[25, 998])
    parser.add_argument("--output", type=Path, default=REPORTS / "schedules")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    family = load_engine(HandlerSettings(model_path=str(args.model)), args.model).family
    names = args.schedulers or sorted(family.schedulers)
    rows = measure(family, names, args.steps)
    data = {"model": str(args.model), "family": family.name, "latent_shape": LATENT_SHAPE, "rows": rows}
    publish(data, table(rows), lambda path: plot(rows, path), args.output, "schedules")


if __name__ == "__main__":
    main()
