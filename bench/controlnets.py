"""`make bench-controlnet`: what ControlNets cost, and what sharing the UNet forward saves, side by side.

On the step engine, the default model at 64x64 (its ``shapes-mask`` ControlNet and a random one of
the same architecture) and SD 1.5's architecture at 256x256 (``bench.sd15``, random weights, two
random ControlNets ``from_unet`` with SD 1.5 ControlNets' conditioning embedding):

- one request (guidance 7.5: 2 rows) with a ControlNet against the same request without;
- 8 one-image requests (16 rows): none with a ControlNet; all 8 with one; half with one and half
  without; half with one ControlNet and half with another. Each mix runs ``shared`` (what the server
  runs: one UNet forward per step for all 8, each ControlNet once over its rows) and ``grouped`` (a
  UNet forward per ControlNet set, as a server that runs a ControlNet pipeline per request or per
  ControlNet does).

Every case steps the same jobs from the same state; the figure is the median seconds of one step of
every job (the sum of its forwards where grouped). Each case is timed right after the plain
workload of its size (paired: the ratio is the median of the rounds' ratios, so a drift of the
machine's speed cancels). Prints the ratios against no ControlNet and writes
``reports/controlnet/controlnet.{json,md,png}``.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from bench import sd15
from bench.pipeline import environment
from bench.report import plot_design_ratios, run_per_model
from handler.adapters.controlnets import ControlSpec
from handler.config import HandlerSettings
from handler.engine.jobs import DenoiseJob, JobSpec
from handler.engine.loading import load_engine, synchronize
from handler.engine.step_engine import StepEngine
from model_making.make_controlnet import SD_EMBEDDING, write_controlnet
from server.paths import CONTROLNET_DIR, DEFAULT_MODEL_DIR

logger = logging.getLogger("bench-controlnet")

DESIGNS = ("shared", "grouped")
PLAIN = "no ControlNet"
ALONE, ALONE_PLAIN = "1 request, a ControlNet", "1 request, none"


@dataclass(frozen=True)
class Model:
    name: str
    model_dir: Path | None  # None: SD 1.5's architecture, written once
    side: int
    trained: Path | None  # a trained ControlNet to time beside a random one (None: two random ones)


MODELS = {
    "default": Model("default", DEFAULT_MODEL_DIR, 64, CONTROLNET_DIR / "shapes-mask"),
    "sd15": Model("sd15", None, 256, None),
}


def workloads(a: str, b: str, control: Image.Image) -> dict[str, list[tuple[ControlSpec, ...]]]:
    """The ControlNets of each request, per workload (``a``, ``b``: loaded ControlNet ids)."""
    with_a, with_b = (ControlSpec(a, control),), (ControlSpec(b, control),)
    return {
        ALONE_PLAIN: [()],
        ALONE: [with_a],
        PLAIN: [()] * 8,
        "one ControlNet, all 8": [with_a] * 8,
        "4 with one, 4 without": [with_a] * 4 + [()] * 4,
        "4 with one, 4 with another": [with_a] * 4 + [with_b] * 4,
    }


def step_seconds(engine: StepEngine, jobs: list[DenoiseJob], design: str) -> tuple[float, int, int]:
    """Seconds of one step of every job, and the UNet and ControlNet forwards it took: one UNet
    forward, or one per ControlNet set (``grouped``)."""
    groups: dict[tuple[str, ...], list[DenoiseJob]] = {}
    for job in jobs:
        key = tuple(control.spec.net for control in job.controls) if design == "grouped" else ()
        groups.setdefault(key, []).append(job)
    started = time.perf_counter()
    control_forwards = sum(engine.step(group) for group in groups.values())
    synchronize(engine.device)
    return time.perf_counter() - started, len(groups), control_forwards


def measure(model: Model, steps: int, repeats: int) -> dict:
    """Median step seconds per workload and design on one model."""
    model_dir = model.model_dir or sd15.ensure_model()
    with tempfile.TemporaryDirectory(prefix="bench-controlnet-") as tmp:
        directory = Path(tmp)
        embedding = SD_EMBEDDING
        if model.trained is None:
            write_controlnet(model_dir, directory / "a", seed=1, spread=0.01, embedding=embedding)
        else:
            shutil.copytree(model.trained, directory / "a")
            embedding = tuple(
                json.loads((model.trained / "config.json").read_text())["conditioning_embedding_out_channels"]
            )
        write_controlnet(model_dir, directory / "b", seed=2, spread=0.01, embedding=embedding)
        engine = load_engine(
            HandlerSettings.model_validate({"model_path": str(model_dir), "controlnets": {"dir": str(directory)}}),
            "/unused",
        )
        a, b = engine.controlnets.acquire(["a", "b"], in_use=())
    control = Image.fromarray(np.random.default_rng(0).integers(0, 256, (model.side, model.side, 3), dtype=np.uint8))
    cases = workloads(a, b, control)
    started = {
        name: engine.start(
            [
                JobSpec(f"a red circle {i}", None, (i,), model.side, model.side, steps + 1, "ddim", 7.5, controls=c)
                for i, c in enumerate(controls)
            ]
        )
        for name, controls in cases.items()
    }
    timed_cases = [(name, design) for name in cases if name not in (PLAIN, ALONE_PLAIN) for design in DESIGNS]
    timed_cases = [(name, design) for name, design in timed_cases if not (name == ALONE and design == "grouped")]
    forwards: dict[tuple[str, str], tuple[int, int]] = {}

    def timed(name: str, design: str) -> list[float]:
        jobs = copy.deepcopy(started[name])
        runs = [step_seconds(engine, jobs, design) for _ in range(steps)]
        forwards[(name, design)] = runs[-1][1:]
        return [seconds for seconds, *_ in runs]

    seconds: dict[tuple[str, str], list[float]] = {case: [] for case in timed_cases}
    ratios: dict[tuple[str, str], list[float]] = {case: [] for case in timed_cases}
    plain: dict[str, list[float]] = {PLAIN: [], ALONE_PLAIN: []}
    for round_ in range(repeats + 1):  # the first round warms up
        for name, design in timed_cases:
            baseline = ALONE_PLAIN if name == ALONE else PLAIN
            before, timings = timed(baseline, "shared"), timed(name, design)  # paired: drift cancels
            ratio = statistics.median(timings) / statistics.median(before)
            if round_:
                plain[baseline].extend(before)
                seconds[(name, design)].extend(timings)
                ratios[(name, design)].append(ratio)
            logger.info("%s round %d of %d: %s, %s: %.2fx", model.name, round_, repeats, name, design, ratio)
    rows = [
        {"workload": name, "design": "shared", "median_s": statistics.median(values), "ratio": 1.0, "forwards": [1, 0]}
        for name, values in plain.items()
    ]
    rows += [
        {
            "workload": name,
            "design": design,
            "median_s": statistics.median(seconds[(name, design)]),
            "ratio": statistics.median(ratios[(name, design)]),
            "forwards": list(forwards[(name, design)]),
        }
        for name, design in timed_cases
    ]
    return {"model": model.name, "side": model.side, "environment": environment(engine.device), "rows": rows}


def table(results: list[dict]) -> str:
    lines = []
    for result in results:
        lines += [
            f"\n{result['model']} ({result['side']}x{result['side']}, guidance 7.5; time of one step of every "
            "request, against the same requests without a ControlNet; UNet + ControlNet forwards per step):\n",
            "| workload | shared (the server) | grouped (a forward per ControlNet set) |",
            "| --- | --- | --- |",
        ]
        by_case = {(row["workload"], row["design"]): row for row in result["rows"]}
        for name in dict.fromkeys(row["workload"] for row in result["rows"]):
            cells = []
            for design in DESIGNS:
                row = by_case.get((name, design))
                cells.append(
                    "—"
                    if row is None
                    else f"{row['median_s'] * 1000:.1f} ms = {row['ratio']:.2f}x ({row['forwards'][0]} + "
                    f"{row['forwards'][1]})"
                )
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> None:
    plot_design_ratios(
        results, DESIGNS, (PLAIN, ALONE_PLAIN), PLAIN, path, lambda r: f"{r['model']} {r['side']}x{r['side']}"
    )


def main() -> None:
    run_per_model(__doc__.splitlines()[0], MODELS, measure, table, plot, "controlnet")


if __name__ == "__main__":
    main()
