"""`make bench-continuous`: the shipped default (continuous batching, one worker) vs dynamic batching.

Both modes run the same step engine on the default model, each on its own TorchServe, with the
shipped model-config.yaml (batch size and delay as shipped) and only the batching mode forced
(``MODES``): dynamic batching, what several workers get and what shipped before, and continuous
batching, what packaging ships for one worker. Each mode's capacity (requests/s, closed loop at
saturation) is measured; then both get the same Poisson arrivals (seeded) at 50%, 70% and 90% of the
dynamic capacity, with a mix of step counts, and a mixed-resolution run at 70%. Client-side
p50/p95/p99 latency and images/s per point go to ``reports/continuous/`` as JSON, a Markdown table
and a latency-vs-load plot.
"""

from __future__ import annotations

import argparse
import logging
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from bench.report import publish
from loadtest.client import closed_loop, post
from server import TorchServe, serve_archive, write_model_config
from server.paths import DEFAULT_MODEL_DIR, REPORTS

logger = logging.getLogger("bench-continuous")

STEP_MIX = (4, 8, 20, 30)
SIDES = {"uniform": (64,), "mixed resolution": (64, 128)}
LOADS = (0.5, 0.7, 0.9)
ENGINES = ("dynamic", "continuous")
MODES = {"dynamic": {"continuousBatching": False}, "continuous": {"continuousBatching": True}}


@dataclass(frozen=True)
class Point:
    engine: str
    mix: str
    load: float
    offered_rps: float
    requests: int
    errors: int
    p50_s: float
    p95_s: float
    p99_s: float
    images_per_s: float


def request_bodies(count: int, sides: tuple[int, ...], seed: int) -> list[dict]:
    draw = random.Random(seed)
    bodies = []
    for index in range(count):
        side = draw.choice(sides)
        bodies.append(
            {
                "prompt": draw.choice(["a red circle", "a blue square", "a green triangle", "a yellow circle"]),
                "seed": index,
                "num_inference_steps": draw.choice(STEP_MIX),
                "width": side,
                "height": side,
            }
        )
    return bodies


def capacity(server: TorchServe, requests_count: int, concurrency: int) -> float:
    """Requests/s at saturation: ``concurrency`` clients sending back to back."""
    results, seconds = closed_loop(server, request_bodies(requests_count, SIDES["uniform"], seed=99), concurrency)
    if not all(ok for _, ok, _ in results):
        raise RuntimeError("requests failed while measuring capacity")
    return len(results) / seconds


def poisson(server: TorchServe, engine: str, mix: str, load: float, rate: float, count: int, seed: int) -> Point:
    """Open-loop Poisson arrivals at ``rate`` requests/s; latency per request from its arrival."""
    bodies = request_bodies(count, SIDES[mix], seed)
    gaps = np.random.default_rng(seed).exponential(1 / rate, size=count)
    begin = time.monotonic()
    with ThreadPoolExecutor(max_workers=128) as pool:
        futures, arrival = [], begin
        for body, gap in zip(bodies, gaps, strict=True):
            arrival += gap
            time.sleep(max(0.0, arrival - time.monotonic()))
            futures.append(pool.submit(post, server, body))
        results = [future.result() for future in futures]
    makespan = time.monotonic() - begin
    latencies = [seconds for seconds, ok, _ in results if ok]
    quantiles = np.quantile(latencies, [0.5, 0.95, 0.99]) if latencies else [float("nan")] * 3
    return Point(
        engine,
        mix,
        load,
        rate,
        count,
        sum(not ok for _, ok, _ in results),
        *map(float, quantiles),
        len(latencies) / makespan,
    )


def run_engine(engine: str, work: Path, measure) -> list[Point]:
    directory = work / engine
    with serve_archive(DEFAULT_MODEL_DIR, write_model_config(directory, **MODES[engine]), directory) as server:
        return measure(server)


def markdown(points: list[Point], capacity_rps: dict[str, float]) -> str:
    """Per-point table, then the ratios the engines are judged by."""
    ratio = capacity_rps["continuous"] / capacity_rps["dynamic"]
    lines = [
        f"Capacity (saturated, {', '.join(f'{engine} {rps:.2f}' for engine, rps in capacity_rps.items())} requests/s): "
        f"continuous / dynamic = {ratio:.2f}x. Loads are fractions of the dynamic capacity.",
        "",
        "| mix | load | engine | offered (req/s) | p50 (s) | p95 (s) | p99 (s) | images/s | errors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for point in points:
        lines.append(
            f"| {point.mix} | {point.load:.0%} | {point.engine} | {point.offered_rps:.2f} | {point.p50_s:.2f} "
            f"| {point.p95_s:.2f} | {point.p99_s:.2f} | {point.images_per_s:.2f} | {point.errors} |"
        )
    lines += [
        "",
        "| mix | load | p95 dynamic / continuous | images/s continuous / dynamic |",
        "| --- | --- | --- | --- |",
    ]
    for mix in SIDES:
        for load in LOADS:
            pair = {p.engine: p for p in points if p.mix == mix and p.load == load}
            if len(pair) == 2:
                lines.append(
                    f"| {mix} | {load:.0%} | {pair['dynamic'].p95_s / pair['continuous'].p95_s:.2f}x "
                    f"| {pair['continuous'].images_per_s / pair['dynamic'].images_per_s:.2f}x |"
                )
    return "\n".join(lines) + "\n"


def plot(points: list[Point], path: Path) -> None:
    figure, (latency, throughput) = plt.subplots(1, 2, figsize=(11, 4.5))
    for engine, color in zip(ENGINES, ("tab:blue", "tab:orange"), strict=True):
        for mix, (style, marker) in zip(SIDES, (("-", "o"), ("--", "s")), strict=True):
            series = sorted((p for p in points if p.engine == engine and p.mix == mix), key=lambda p: p.load)
            if not series:
                continue
            loads = [p.load * 100 for p in series]
            latency.plot(loads, [p.p95_s for p in series], style, marker=marker, color=color, label=f"{engine}, {mix}")
            throughput.plot(
                loads, [p.images_per_s for p in series], style, marker=marker, color=color, label=f"{engine}, {mix}"
            )
    latency.set_xlabel("offered load (% of dynamic batching's capacity)")
    latency.set_ylabel("p95 latency (s)")
    throughput.set_xlabel("offered load (% of dynamic batching's capacity)")
    throughput.set_ylabel("images/s")
    latency.legend(fontsize=8)
    figure.suptitle("Poisson arrivals, steps drawn from " + ", ".join(map(str, STEP_MIX)))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=80, help="requests per load point")
    parser.add_argument("--capacity-requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8, help="closed-loop clients for the capacity measurement")
    parser.add_argument("--output", type=Path, default=REPORTS / "continuous")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    points: list[Point] = []
    measured: dict[str, float] = {}

    def measure(engine: str):
        def on(server: TorchServe) -> list[Point]:
            capacity(server, 8, args.concurrency)  # warm-up
            measured[engine] = capacity(server, args.capacity_requests, args.concurrency)
            logger.info("%s capacity: %.2f requests/s", engine, measured[engine])
            results = []
            for mix in SIDES:
                for load in LOADS if mix == "uniform" else (0.7,):
                    point = poisson(
                        server, engine, mix, load, load * measured["dynamic"], args.requests, seed=int(load * 100)
                    )
                    logger.info("%s", point)
                    results.append(point)
            return results

        return on

    with tempfile.TemporaryDirectory(prefix="bench-continuous-") as tmp:
        for engine in ENGINES:
            points += run_engine(engine, Path(tmp), measure(engine))
    figures = {"capacity_rps": measured, "step_mix": STEP_MIX, "points": [asdict(p) for p in points]}
    publish(figures, markdown(points, measured), lambda path: plot(points, path), args.output, "continuous")


if __name__ == "__main__":
    main()
