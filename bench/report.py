"""The pipeline benchmark's report: JSON (everything), a Markdown table and a PNG chart."""

from __future__ import annotations

import argparse
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from server.paths import REPORTS  # noqa: E402


def number_text(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table of ``rows`` (cells as text) under ``header``."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


def _significant(value: float) -> str:
    """Three significant digits, without exponent notation."""
    return f"{value:.{max(0, 2 - math.floor(math.log10(abs(value))))}f}" if value else "0"


def _mib(value: float) -> str:
    return f"{value:.1f}" if value < 10 else f"{value:.0f}"


def _flops(value: float) -> str:
    return f"{value / 1e12:.3f} TFLOP" if value >= 1e11 else f"{value / 1e9:.3f} GFLOP"


def _psnr(result: dict) -> str:
    if "max_abs_diff" not in result:
        return "—"
    return "identical" if result["psnr_db"] is None else f"{result['psnr_db']:.1f}"


def distance_text(distance: dict) -> str:
    """An image distance (``bench.pipeline.image_distance``) in words."""
    if distance["psnr_db"] is None:
        return "identical"
    return f"max abs diff {distance['max_abs_diff']}, PSNR {distance['psnr_db']:.1f} dB"


def _variant_row(variant: dict) -> str:
    if variant["status"] != "ok":
        note = variant.get("reason") or variant.get("error", "")
        return f"| {variant['name']} | {variant['status']}: {note[:120]} |" + " |" * 11
    warm = variant.get("warm", {})
    cold_s = variant["warmup_overhead_s"] if warm else None
    speedup = f"{variant['speedup']:.2f}x" if "speedup" in variant else "—"
    tflops = _significant(variant["unet_tflops"]) if "unet_tflops" in variant else "—"
    return (
        f"| {variant['name']} | {variant['dtype']} | {variant['latency_s']:.3f} | {speedup} "
        f"| {_significant(variant['images_per_s'])} | {_significant(variant['unet_it_s'])} | {tflops} "
        f"| {_mib(variant['peak_memory_mib'])} | {number_text(cold_s, 1)} "
        f"| {number_text(warm.get('warmup_overhead_s'), 1)} "
        f"| {variant.get('max_batch', '—')} | {variant.get('max_abs_diff', '—')} | {_psnr(variant)} |"
    )


def variants_table(report: dict) -> str:
    header = (
        "| variant | dtype | latency (s) | speed-up | images/s | UNet it/s | UNet TFLOP/s | peak memory (MiB) "
        "| compile cold (s) | compile warm (s) | max batch | max abs diff | PSNR (dB) |"
    )
    return "\n".join([header, "|" + " --- |" * 13] + [_variant_row(variant) for variant in report["variants"]])


def attention_table(report: dict) -> str:
    header = (
        "| case | dtype | vanilla (ms) | SDPA (ms) | speed-up | vanilla peak (MiB) | SDPA peak (MiB) "
        "| score matrix (MiB) | max abs diff |"
    )
    rows = [
        f"| {row['case']} | {row['dtype']} | {row['vanilla']['median_ms']:.1f} | {row['sdpa']['median_ms']:.1f} "
        f"| {row['speedup']:.2f}x | {_mib(row['vanilla']['peak_memory_mib'])} | {_mib(row['sdpa']['peak_memory_mib'])} "
        f"| {row['score_matrix_mib']:.0f} | {row['max_abs_diff']:.1e} |"
        for row in report["attention"]
    ]
    return "\n".join([header, "|" + " --- |" * 9] + rows)


def markdown(report: dict) -> str:
    workload, environment = report["workload"], report["environment"]
    flops = next(
        (variant.get("unet_call_flops") for variant in report["variants"] if variant.get("unet_call_flops")), None
    )
    memory = next((variant["memory_measure"] for variant in report["variants"] if variant["status"] == "ok"), "")
    lines = [
        f"# Pipeline benchmark: {report['model']} on {environment['device_name']} ({environment['date']})",
        "",
        f"{workload['width']}x{workload['height']}, {workload['steps']} {workload['scheduler']} steps, batch "
        f"{workload['batch']}, guidance {workload['guidance_scale']}; median of {workload['repeats']} calls after a "
        f"warm-up call. torch {environment['torch']}, diffusers {environment['diffusers']}. Speed-up and image "
        f"distance are against `{report['baseline']}`. Peak memory: {memory}. Compile cold/warm: the first call's "
        "extra time with an empty inductor cache and with the cache the cold run left."
        + (f" One UNet call: {_flops(flops)} (FlopCounterMode)." if flops else ""),
        "",
        variants_table(report),
        "",
        "## Attention at SD 1.5 shapes (batch 2, 8 heads x 40)",
        "",
        attention_table(report),
        "",
    ]
    return "\n".join(lines)


def chart(report: dict, path: Path) -> None:
    measured = [variant for variant in report["variants"] if variant["status"] == "ok"]
    names = [variant["name"] for variant in measured]
    figure, axes = plt.subplots(2, 2, figsize=(13, 8))
    speed, memory, compile_axis, attention = axes.flat
    speed.barh(names, [variant.get("speedup", 0) for variant in measured], color="tab:blue")
    speed.axvline(1, color="black", linewidth=0.8)
    speed.set_xlabel(f"speed-up vs {report['baseline']} (end-to-end latency)")
    for index, variant in enumerate(measured):
        speed.annotate(f" PSNR {_psnr(variant)}", (variant.get("speedup", 0), index), va="center", fontsize=7)
    memory.barh(names, [variant["peak_memory_mib"] for variant in measured], color="tab:orange")
    speed.invert_yaxis()
    memory.invert_yaxis()
    memory.set_xlabel(f"peak memory (MiB, {measured[0]['memory_measure'] if measured else ''})")
    compiled = [variant for variant in measured if "warm" in variant]
    positions = range(len(compiled))
    compile_axis.bar([p - 0.2 for p in positions], [v["warmup_overhead_s"] for v in compiled], 0.4, label="cold cache")
    compile_axis.bar(
        [p + 0.2 for p in positions], [v["warm"].get("warmup_overhead_s", 0) for v in compiled], 0.4, label="warm cache"
    )
    compile_axis.set_xticks(list(positions), [v["name"] for v in compiled], fontsize=8)
    compile_axis.set_ylabel("first-call compile time (s)")
    compile_axis.legend()
    labels = [f"{row['case']}\n{row['dtype']}" for row in report["attention"]]
    spots = range(len(labels))
    attention.bar(
        [p - 0.2 for p in spots], [row["vanilla"]["median_ms"] for row in report["attention"]], 0.4, label="vanilla"
    )
    attention.bar(
        [p + 0.2 for p in spots], [row["sdpa"]["median_ms"] for row in report["attention"]], 0.4, label="SDPA"
    )
    attention.set_xticks(list(spots), labels, fontsize=8)
    attention.set_ylabel("attention time (ms)")
    attention.legend()
    workload, environment = report["workload"], report["environment"]
    figure.suptitle(
        f"{report['model']} {workload['width']}x{workload['height']}, {workload['steps']} steps, batch "
        f"{workload['batch']} on {environment['device_name']} ({environment['date']})"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def publish(data: dict, table: str, plot: Callable[[Path], None], directory: Path, name: str) -> list[Path]:
    """What every benchmark leaves: ``NAME.json`` (the figures), ``NAME.md`` (the table, also printed)
    and ``NAME.png`` (drawn by ``plot``) in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"{name}.json", directory / f"{name}.md", directory / f"{name}.png"]
    paths[0].write_text(json.dumps(data, indent=2))
    paths[1].write_text(table)
    plot(paths[2])
    print(table)
    return paths


def plot_design_ratios(
    results: list[dict],
    designs: tuple[str, ...],
    baselines: tuple[str, ...],
    what: str,
    path: Path,
    title: Callable[[dict], str],
    goal: Callable[[dict], float | None] = lambda result: None,
) -> None:
    """One panel per model: per workload (but the ``baselines``), a bar per design with its ratio to
    ``what`` (missing: 0), the 1.0 line and, where ``goal`` gives one, the goal's."""
    figure, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for axis, result in zip(axes[0], results, strict=True):
        names = [n for n in dict.fromkeys(row["workload"] for row in result["rows"]) if n not in baselines]
        by_case = {(row["workload"], row["design"]): row["ratio"] for row in result["rows"]}
        width = 0.8 / len(designs)
        for index, design in enumerate(designs):
            positions = [position + index * width for position in range(len(names))]
            axis.bar(positions, [by_case.get((name, design), 0.0) for name in names], width, label=design)
        axis.axhline(1.0, color="black", linewidth=0.8)
        target = goal(result)
        if target is not None:
            axis.axhline(target, color="red", linestyle="--", linewidth=0.8, label="goal")
        centres = [position + width * (len(designs) - 1) / 2 for position in range(len(names))]
        axis.set_xticks(centres, [name.replace(", ", ",\n") for name in names], fontsize=7)
        axis.set_ylabel(f"step time / {what}")
        axis.set_title(title(result))
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def run_per_model(
    description: str,
    models: dict[str, Any],
    measure: Callable[[Any, int, int], dict],
    table: Callable[[list[dict]], str],
    plot: Callable[[list[dict], Path], None],
    name: str,
) -> None:
    """The command line of a benchmark measured per model (``make bench-lora``, ``bench-controlnet``):
    ``--models``, ``--steps`` timed per round (default 10, SD 1.5: 1), ``--repeats`` and ``--output``
    (``reports/NAME``); publishes the results of every model."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--models", nargs="+", choices=list(models), default=list(models))
    parser.add_argument("--steps", type=int, default=None, help="steps timed per round (default: 10, SD 1.5: 1)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=REPORTS / name)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    results = [
        measure(models[model], args.steps or (1 if model == "sd15" else 10), args.repeats) for model in args.models
    ]
    publish({"results": results}, table(results), lambda path: plot(results, path), args.output, name)


def write_report(report: dict, directory: Path, name: str) -> list[Path]:
    return publish(report, markdown(report), lambda path: chart(report, path), directory, name)
