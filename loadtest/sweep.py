"""`make sweep`: every batch size / batch delay / workers / concurrency point of benchmark_config.yaml,
on a TorchServe of its own (loopback, free ports, model API on for registration), each setting
applied for real and verified through the describe API, then measured with locust and the
server's metrics. Writes the report under ``reports/sweep-<time>/``.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

import requests
from tqdm import tqdm

from loadtest.config import BenchmarkConfig, SweepPoint
from loadtest.report import write_report
from loadtest.results import PointResult, server_figures
from loadtest.run import run_locust
from server import TorchServe, build, start_on_free_ports, write_model_config
from server.paths import BENCHMARK_CONFIG, REPORTS, ROOT

logger = logging.getLogger("sweep")

REGISTER_TIMEOUT_S = 600


class ModelRegistration:
    """Register, scale, verify and unregister the model on the sweep's own server."""

    def __init__(self, server: TorchServe):
        self.server = server
        self.url = f"{server.addresses.management}/models"

    def _call(self, method: str, endpoint: str, **params) -> dict:
        response = requests.request(
            method, endpoint, params=params, headers=self.server.auth(management=True), timeout=REGISTER_TIMEOUT_S
        )
        if response.status_code != 200:
            raise RuntimeError(f"{method} {endpoint} {params} -> {response.status_code}: {response.text}")
        return response.json()

    def register(self, archive: str, batch_size: int, max_batch_delay: int, workers: int) -> None:
        """Register ``archive`` (a file in the model store) under the server's model name."""
        self._call(
            "POST",
            self.url,
            url=archive,
            model_name=self.server.model_name,
            batch_size=batch_size,
            max_batch_delay=max_batch_delay,
            initial_workers=workers,
            synchronous="true",
        )
        self.verify(batch_size, max_batch_delay, workers)

    def scale(self, workers: int) -> None:
        response = self.server.scale(workers, timeout=REGISTER_TIMEOUT_S)
        if response.status_code != 200:
            raise RuntimeError(f"scaling to {workers} workers -> {response.status_code}: {response.text}")

    def verify(self, batch_size: int, max_batch_delay: int, workers: int) -> None:
        """Fail unless the describe API shows exactly these settings and that many READY workers."""
        described = self.server.describe()
        ready = [worker for worker in described["workers"] if worker["status"] == "READY"]
        shown = (described["batchSize"], described["maxBatchDelay"], described["minWorkers"], len(ready))
        if shown != (batch_size, max_batch_delay, workers, workers):
            raise RuntimeError(
                f"describe shows batchSize/maxBatchDelay/minWorkers/ready workers {shown}, "
                f"expected {(batch_size, max_batch_delay, workers, workers)}"
            )

    def unregister(self) -> None:
        self._call("DELETE", self.server.model_url)


def warm_up(server: TorchServe, config: BenchmarkConfig) -> None:
    """Requests of every kind in the mix, not measured; a refused one stops the sweep, naming its
    kind and the server's answer (a kind's fields are checked by the server)."""
    for index in range(config.warmup_requests):
        entry = config.request_mix[index % len(config.request_mix)]
        answer = requests.post(
            server.predictions_url, json=entry.body("warm-up"), headers=server.auth(), timeout=REGISTER_TIMEOUT_S
        )
        if not answer.ok:
            raise RuntimeError(f"warm-up request {entry.name!r} answered {answer.status_code}: {answer.text[:500]}")


def measure(
    server: TorchServe, config_path: Path, config: BenchmarkConfig, point: SweepPoint, out: Path
) -> PointResult:
    warm_up(server, config)
    before = server.settled_metric_samples()  # the warm-up's last lines parsed, not counted in the point
    slug = f"{point.mode}-b{point.batch_size}-d{point.max_batch_delay}-w{point.workers}-c{point.concurrency}"
    client = run_locust(
        config_path,
        server.addresses.inference,
        server.keys.inference,
        users=point.concurrency,
        spawn_rate=point.concurrency,
        requests=config.sweep.requests_per_point,
        duration_s=config.sweep.duration_s_per_point,
        report_prefix=out / "points" / slug,
        model_name=server.model_name,
    )
    violations = client.sla_violations(config.sla)
    return PointResult(
        point,
        client,
        server_figures(before, server.settled_metric_samples()),
        not violations,
        violations,
        str(out / "points" / f"{slug}_requests.csv"),
    )


def run_sweep(config_path: Path, out: Path) -> list[PointResult]:
    config = BenchmarkConfig.load(config_path)
    points = config.sweep.points()
    results: list[PointResult] = []
    model_dir = config.model.model_dir if config.model.model_dir.is_absolute() else ROOT / config.model.model_dir
    with tempfile.TemporaryDirectory(prefix="sweep-") as tmp:
        workdir = Path(tmp)
        archives = {
            mode: build(
                model_dir,
                write_model_config(workdir / f"config-{mode}", continuousBatching=mode),
                workdir / "model_store",
                model_name=f"{config.model.name}-{'continuous' if mode else 'dynamic'}",
            ).name
            for mode in sorted(set(config.sweep.continuous_batching))
        }
        server = start_on_free_ports(
            workdir / "model_store",
            workdir,
            model_name=config.model.name,
            env={"TMPDIR": tmp},
            load_model=False,
            enable_model_api="true",
        )
        try:
            registration = ModelRegistration(server)
            progress = tqdm(points, desc="sweep", unit="point")
            registered: tuple[bool, int, int] | None = None
            for point in progress:
                progress.set_postfix_str(point.label)
                if registered != (point.continuous_batching, point.batch_size, point.max_batch_delay):
                    if registered is not None:
                        registration.unregister()
                    registration.register(
                        archives[point.continuous_batching], point.batch_size, point.max_batch_delay, point.workers
                    )
                    registered = (point.continuous_batching, point.batch_size, point.max_batch_delay)
                registration.scale(point.workers)
                registration.verify(point.batch_size, point.max_batch_delay, point.workers)
                result = measure(server, config_path, config, point, out)
                results.append(result)
                tqdm.write(
                    f"{point.label}: {result.client.images_per_s:.2f} images/s, p95 {result.client.p95_s:.2f} s, "
                    f"errors {result.client.error_ratio:.1%}, {'meets' if result.meets_sla else 'misses'} the SLA"
                )
        finally:
            server.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=BENCHMARK_CONFIG)
    parser.add_argument("--output", type=Path, help="report directory (default reports/sweep-<time>)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    out = args.output or REPORTS / time.strftime("sweep-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    results = run_sweep(args.config.resolve(), out)
    report = write_report(results, BenchmarkConfig.load(args.config), out)
    print(f"report: {report}", flush=True)


if __name__ == "__main__":
    main()
