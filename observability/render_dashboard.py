"""Drive a short load against a fresh TorchServe with a real Prometheus, then render the dashboard's
panels from Prometheus ``query_range`` into a PNG (Grafana itself does not run here).

    python -m observability.render_dashboard --duration 120 --output docs/img/dashboard.png
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import matplotlib.pyplot as plt
import requests

from observability.build_dashboard import GPU_ONLY
from observability.build_dashboard import OUTPUT as DASHBOARD
from observability.prometheus import Prometheus
from server import TorchServe, serve_archive
from server.paths import DEFAULT_MODEL_DIR, DOCS_IMG, MODEL_CONFIG

logger = logging.getLogger("render_dashboard")

# A mix like the one users send: sizes, steps, image counts; every 20th request is invalid.
SIZES = [64, 64, 64, 128]
STEPS = [4, 8, 12, 20]


def drive_load(server: TorchServe, duration: float, concurrency: int) -> dict[int, int]:
    """Send a request mix from ``concurrency`` threads for ``duration`` seconds; count statuses."""
    deadline = time.monotonic() + duration
    statuses: dict[int, int] = {}
    lock = threading.Lock()

    def user(seed: int) -> None:
        chooser = random.Random(seed)
        while time.monotonic() < deadline:
            side = chooser.choice(SIZES)
            body = {
                "prompt": "a red circle",
                "width": side,
                "height": side,
                "num_inference_steps": chooser.choice(STEPS),
                "num_images_per_prompt": chooser.choice([1, 1, 1, 2]),
                "seed": chooser.randrange(1000),
            }
            if chooser.random() < 0.05:
                body["width"] = 100
            status = requests.post(server.predictions_url, json=body, headers=server.auth(), timeout=300).status_code
            with lock:
                statuses[status] = statuses.get(status, 0) + 1

    def progress() -> None:
        while time.monotonic() < deadline:
            time.sleep(10)
            with lock:
                done = sum(statuses.values())
            logger.info("load: %d requests answered, %.0f s left", done, max(0.0, deadline - time.monotonic()))

    threading.Thread(target=progress, daemon=True).start()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(user, range(concurrency)))
    return statuses


def plot(prometheus: Prometheus, start: float, end: float, output: Path, model: str) -> None:
    """One subplot per dashboard time-series panel (the GPU panel left out: the rendered server runs
    on a CPU)."""
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [
        panel for panel in dashboard["panels"] if panel["type"] == "timeseries" and panel.get("description") != GPU_ONLY
    ]
    columns = 3
    rows = -(-len(panels) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(6 * columns, 3.6 * rows), squeeze=False)
    step = max(1.0, (end - start) / 300)
    for axis, panel in zip(axes.flat, panels, strict=False):
        for target in panel["targets"]:
            for series in prometheus.query_range(target["expr"].replace("$model", model), start, end, step):
                label = target["legendFormat"]
                for key, value in series["metric"].items():
                    label = label.replace(f"{{{{{key}}}}}", value)
                times = [float(point[0]) - start for point in series["values"]]
                values = [float(point[1]) for point in series["values"]]
                style = "--" if label.startswith("SLA") else "-"
                axis.plot(times, values, style, label=label.replace(f" {model}", ""))
        unit = panel["fieldConfig"]["defaults"].get("unit", "")
        axis.set_title(panel["title"], fontsize=10)
        axis.set_xlabel("seconds into the run", fontsize=8)
        axis.set_ylabel(unit, fontsize=8)
        axis.tick_params(labelsize=7)
        axis.legend(fontsize=7, loc="upper left")
        axis.grid(alpha=0.3)
    for axis in axes.flat[len(panels) :]:
        axis.axis("off")
    figure.suptitle("Stable Diffusion on TorchServe: dashboard panels from Prometheus query_range", fontsize=12)
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=90)
    logger.info("dashboard panels written to %s", output)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--output", type=Path, default=DOCS_IMG / "dashboard.png")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    with tempfile.TemporaryDirectory(prefix="render-dashboard-") as tmp:
        workdir = Path(tmp)
        with serve_archive(DEFAULT_MODEL_DIR, MODEL_CONFIG, workdir, metric_time_interval="10") as server:
            with Prometheus(server.addresses.metrics, workdir / "prometheus") as prometheus:
                prometheus.wait_for('up{job="torchserve"} == 1')
                start = time.time()
                statuses = drive_load(server, args.duration, args.concurrency)
                time.sleep(5)
                end = time.time()
                logger.info("responses by status: %s", dict(sorted(statuses.items())))
                plot(prometheus, start - 5, end, args.output, server.model_name)


if __name__ == "__main__":
    main()
