"""The sweep report: all points as CSV/JSON, a Markdown table, PNG plots, the best configuration
that meets the SLA and a ready model-config.yaml snippet for it."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from loadtest.config import BenchmarkConfig
from loadtest.results import PointResult


def best_point(results: list[PointResult]) -> PointResult | None:
    """The highest image throughput among the points that meet the SLA (ties: lower p95)."""
    meeting = [result for result in results if result.meets_sla]
    return max(meeting, key=lambda result: (result.client.images_per_s, -result.client.p95_s), default=None)


def model_config_snippet(result: PointResult) -> str:
    point = result.point
    return (
        f"continuousBatching: {str(point.continuous_batching).lower()}\n"
        f"batchSize: {point.batch_size}\n"
        f"maxBatchDelay: {point.max_batch_delay}\n"
        f"minWorkers: {point.workers}\n"
        f"maxWorkers: {point.workers}\n"
    )


def markdown_table(results: list[PointResult]) -> str:
    header = (
        "| batching | batch size | delay (ms) | workers | users | images/s | requests/s | p50 (s) | p95 (s) | p99 (s) "
        "| errors | queue (s) | handler (s) | mean batch | images per forward | meets SLA |"
    )
    lines = [header, "|" + "|".join([" --- "] * (header.count("|") - 1)) + "|"]
    for result in results:
        point, client, server = result.point, result.client, result.server
        lines.append(
            f"| {point.mode} | {point.batch_size} | {point.max_batch_delay} | {point.workers} | {point.concurrency} "
            f"| {client.images_per_s:.2f} | {client.requests_per_s:.2f} | {client.p50_s:.2f} | {client.p95_s:.2f} "
            f"| {client.p99_s:.2f} | {client.error_ratio:.1%} | {server.mean_queue_s:.2f} "
            f"| {server.mean_handler_s:.2f} "
            f"| {server.mean_batch_size:.2f} | {server.mean_step_images:.2f} | {'yes' if result.meets_sla else 'no'} |"
        )
    return "\n".join(lines)


def plot_throughput_vs_p95(results: list[PointResult], config: BenchmarkConfig, path: Path) -> None:
    figure, axis = plt.subplots(figsize=(8, 5))
    for result in results:
        color = "tab:green" if result.meets_sla else "tab:red"
        axis.scatter(result.client.p95_s, result.client.images_per_s, color=color, s=50)
        axis.annotate(
            result.point.label,
            (result.client.p95_s, result.client.images_per_s),
            fontsize=7,
            xytext=(4, 4),
            textcoords="offset points",
        )
    axis.axvline(config.sla.p95_seconds, color="tab:red", linestyle="--", label=f"SLA p95 {config.sla.p95_seconds:g} s")
    axis.set_xlabel("client p95 latency (s)")
    axis.set_ylabel("throughput (images/s)")
    axis.set_title("Throughput vs p95 latency per configuration (green: meets the SLA)")
    axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def plot_latency_distribution(result: PointResult, config: BenchmarkConfig, path: Path) -> None:
    with open(result.request_log) as log:
        latencies = np.array([float(row["latency_s"]) for row in csv.DictReader(log) if row["ok"] == "1"])
    figure, axis = plt.subplots(figsize=(8, 5))
    axis.hist(latencies, bins=min(40, max(5, len(latencies) // 3)), color="tab:blue", alpha=0.8)
    for quantile, style in ((50, ":"), (95, "--"), (99, "-.")):
        axis.axvline(np.percentile(latencies, quantile), color="black", linestyle=style, label=f"p{quantile}")
    axis.axvline(config.sla.p95_seconds, color="tab:red", linestyle="--", label="SLA p95")
    axis.set_xlabel("latency (s)")
    axis.set_ylabel("requests")
    axis.set_title(f"Latency distribution, best configuration: {result.point.label}")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def write_report(results: list[PointResult], config: BenchmarkConfig, out: Path) -> Path:
    """Write every artefact under ``out``; return the Markdown report's path."""
    rows = [result.as_row() for result in results]
    (out / "points.json").write_text(json.dumps(rows, indent=2))
    with open(out / "points.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[key for key in rows[0] if key != "percentiles_s"])
        writer.writeheader()
        writer.writerows([{key: value for key, value in row.items() if key != "percentiles_s"} for row in rows])
    plot_throughput_vs_p95(results, config, out / "throughput_vs_p95.png")
    best = best_point(results)
    lines = [
        "# Sweep report",
        "",
        f"Model `{config.model.name}` from `{config.model.model_dir}`. SLA: p95 <= {config.sla.p95_seconds:g} s, "
        f"error ratio <= {config.sla.max_error_ratio:.1%}. Up to {config.sweep.requests_per_point} requests or "
        f"{config.sweep.duration_s_per_point:g} s per point after {config.warmup_requests} warm-up requests. "
        "Client figures from locust (exact percentiles from every request); queue, handler time, batch size "
        "(requests admitted together) and images per UNet forward from the server's metrics.",
        "",
        markdown_table(results),
        "",
        "![Throughput vs p95](throughput_vs_p95.png)",
        "",
    ]
    if best is None:
        closest = min(results, key=lambda result: result.client.p95_s)
        lines += [
            "## Best configuration",
            "",
            f"No configuration meets the SLA. Closest: {closest.point.label} ({'; '.join(closest.violations)}).",
            "",
        ]
    else:
        plot_latency_distribution(best, config, out / "best_latency_distribution.png")
        snippet = model_config_snippet(best)
        (out / "model-config-snippet.yaml").write_text(snippet)
        lines += [
            "## Best configuration",
            "",
            f"**{best.point.label}**: {best.client.images_per_s:.2f} images/s at p95 {best.client.p95_s:.2f} s "
            f"(highest throughput among the configurations that meet the SLA).",
            "",
            "![Latency distribution of the best configuration](best_latency_distribution.png)",
            "",
            "Ready `model-config.yaml` settings:",
            "",
            "```yaml",
            snippet.rstrip(),
            "```",
            "",
        ]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path
