"""`make loadtest`: locust, headless and bounded, against a running server; judged against the SLA.

Writes locust's CSV and HTML reports under ``reports/loadtest/`` and exits non-zero, saying which,
when p95 latency exceeds the SLA or the error ratio exceeds its limit.
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from loadtest.config import SLA, BenchmarkConfig
from server import KEY_FILE, Addresses, Keys, read_properties
from server.paths import BENCHMARK_CONFIG, CONFIG_PROPERTIES, REPORTS, ROOT, RUNTIME

logger = logging.getLogger("loadtest")

LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
PERCENTILES = (50, 66, 75, 80, 90, 95, 98, 99, 99.9, 100)


@dataclass(frozen=True)
class LoadResult:
    """Client-side figures of one locust run (latencies in seconds)."""

    requests: int
    failures: int
    p50_s: float
    p95_s: float
    p99_s: float
    requests_per_s: float
    images_per_s: float
    percentiles_s: dict[str, float]
    retries: int = 0  # attempts sent again after their connection ended without an answer

    @property
    def error_ratio(self) -> float:
        return self.failures / self.requests if self.requests else 1.0

    def sla_violations(self, sla: SLA) -> list[str]:
        """What breaks the SLA, in words; empty when it is met."""
        problems = []
        if self.requests == 0:
            problems.append("no request was answered")
        if self.p95_s > sla.p95_seconds:
            problems.append(f"p95 latency {self.p95_s:.3f} s exceeds the SLA {sla.p95_seconds:.3f} s")
        if self.error_ratio > sla.max_error_ratio:
            problems.append(
                f"error ratio {self.error_ratio:.2%} ({self.failures} of {self.requests}) "
                f"exceeds {sla.max_error_ratio:.2%}"
            )
        return problems

    def as_dict(self) -> dict:
        return {**asdict(self), "error_ratio": self.error_ratio}


def summarize(request_log: Path) -> LoadResult:
    """Exact figures from the locustfile's per-request log."""
    rows = list(csv.DictReader(request_log.open()))
    latencies = np.array([float(row["latency_s"]) for row in rows])
    succeeded = [row for row in rows if row["ok"] == "1"]
    ends = [float(row["end_time"]) for row in rows]
    starts = [end - latency for end, latency in zip(ends, latencies, strict=True)]
    elapsed = max(ends) - min(starts) if rows else 0.0
    quantiles = {f"{q:g}%": float(np.percentile(latencies, q)) if rows else 0.0 for q in PERCENTILES}
    return LoadResult(
        requests=len(rows),
        failures=len(rows) - len(succeeded),
        p50_s=quantiles["50%"],
        p95_s=quantiles["95%"],
        p99_s=quantiles["99%"],
        requests_per_s=len(succeeded) / elapsed if elapsed else 0.0,
        images_per_s=sum(int(row["images"]) for row in succeeded) / elapsed if elapsed else 0.0,
        percentiles_s=quantiles,
        retries=sum(int(row.get("retries") or 0) for row in rows),
    )


def run_locust(
    config_path: Path,
    host: str,
    key: str,
    users: int,
    spawn_rate: float,
    requests: int,
    duration_s: float,
    report_prefix: Path,
    model_name: str | None = None,
) -> LoadResult:
    """Run locust headless (bounded by requests and time) and return its figures."""
    report_prefix.parent.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "--host",
        host,
        "--users",
        str(users),
        "--spawn-rate",
        str(spawn_rate),
        "--run-time",
        f"{int(duration_s)}s",
        "--stop-timeout",
        "60",
        "--csv",
        str(report_prefix),
        "--html",
        f"{report_prefix}.html",
        "--only-summary",
        "--exit-code-on-error",
        "0",
        "--loglevel",
        "WARNING",
    ]
    env = {
        **os.environ,
        "LOADTEST_CONFIG": str(config_path),
        "LOADTEST_KEY": key,
        "LOADTEST_MAX_REQUESTS": str(requests),
        "LOADTEST_MODEL": model_name or BenchmarkConfig.load(config_path).model.name,
        "LOADTEST_REQUEST_LOG": f"{report_prefix}_requests.csv",
        "PYTHONPATH": str(ROOT),
    }
    logger.info("locust: %d users, at most %d requests or %.0f s against %s", users, requests, duration_s, host)
    with open(f"{report_prefix}_locust.log", "w") as log:
        subprocess.run(command, env=env, check=True, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    return summarize(Path(f"{report_prefix}_requests.csv"))


def main() -> None:
    parser = argparse.ArgumentParser(description="Load-test a running server against the SLA of benchmark_config.yaml.")
    parser.add_argument("--config", type=Path, default=BENCHMARK_CONFIG)
    parser.add_argument(
        "--server-config",
        type=Path,
        default=CONFIG_PROPERTIES,
        help="config.properties of the server (its inference address)",
    )
    parser.add_argument("--key-file", type=Path, default=RUNTIME / KEY_FILE)
    parser.add_argument("--users", type=int, help="override loadtest.users")
    parser.add_argument("--requests", type=int, help="override loadtest.requests")
    parser.add_argument("--duration", type=float, help="override loadtest.duration_s")
    parser.add_argument("--p95", type=float, help="override sla.p95_seconds")
    parser.add_argument("--report-dir", type=Path, default=REPORTS / "loadtest")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")

    config = BenchmarkConfig.load(args.config)
    section = config.loadtest
    sla = SLA(p95_seconds=args.p95 or config.sla.p95_seconds, max_error_ratio=config.sla.max_error_ratio)
    result = run_locust(
        args.config,
        Addresses.from_properties(read_properties(args.server_config)).inference,
        Keys.from_key_file(args.key_file).inference,
        users=args.users or section.users,
        spawn_rate=section.spawn_rate,
        requests=args.requests or section.requests,
        duration_s=args.duration or section.duration_s,
        report_prefix=args.report_dir / "loadtest",
    )
    print(
        f"{result.requests} requests, {result.failures} failed ({result.error_ratio:.2%}), {result.retries} retried; "
        f"p50 {result.p50_s:.3f} s, p95 {result.p95_s:.3f} s, p99 {result.p99_s:.3f} s; "
        f"{result.requests_per_s:.2f} requests/s, {result.images_per_s:.2f} images/s. "
        f"Reports: {args.report_dir}/",
        flush=True,
    )
    problems = result.sla_violations(sla)
    if problems:
        print("SLA NOT MET: " + "; ".join(problems), flush=True)
        raise SystemExit(1)
    print(f"SLA met: p95 <= {sla.p95_seconds} s and error ratio <= {sla.max_error_ratio:.2%}", flush=True)


if __name__ == "__main__":
    main()
