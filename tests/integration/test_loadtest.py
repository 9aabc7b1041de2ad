"""`make loadtest` and `make sweep` for real: locust against TorchServe, the SLA verdict, the report."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
import yaml

from server.paths import BENCHMARK_CONFIG, ROOT

pytestmark = pytest.mark.slow


def run_loadtest(server, tmp_path, *extra: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "loadtest.run",
        "--server-config",
        str(server.workdir / "config.properties"),
        "--key-file",
        str(server.workdir / "key_file.json"),
        "--users",
        "2",
        "--requests",
        "6",
        "--duration",
        "90",
        "--report-dir",
        str(tmp_path),
        *extra,
    ]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_loadtest_checks_images_and_meets_a_loose_sla(server, tmp_path):
    result = run_loadtest(server, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SLA met" in result.stdout
    rows = list(csv.DictReader((tmp_path / "loadtest_requests.csv").open()))
    assert len(rows) >= 6 and all(row["ok"] == "1" for row in rows)
    assert (tmp_path / "loadtest.html").is_file() and (tmp_path / "loadtest_stats.csv").is_file()


def test_an_impossible_sla_fails_the_loadtest_and_says_why(server, tmp_path):
    result = run_loadtest(server, tmp_path, "--p95", "0.001")
    assert result.returncode == 1
    assert "SLA NOT MET: p95 latency" in result.stdout and "exceeds the SLA 0.001 s" in result.stdout


def test_sweep_over_both_modes_writes_a_report_naming_the_best(tmp_path):
    config = yaml.safe_load(BENCHMARK_CONFIG.read_text())
    config["sweep"] = {
        "continuous_batching": [False, True],
        "batch_size": [1, 4],
        "max_batch_delay": [50],
        "workers": [1],
        "concurrency": [4],
        "requests_per_point": 8,
        "duration_s_per_point": 90,
    }
    config["sla"] = {"p95_seconds": 60.0, "max_error_ratio": 0.0}
    # first, so the warm-up (which raises on a refusal) sends it: a kind with its own request fields,
    # half the mix (32 requests all of other kinds: one chance in 2^32)
    own = {"scheduler": "euler_a", "guidance_scale": 1.0, "clip_skip": 1, "negative_prompt": "blurry"}
    config["request_mix"].insert(0, {"weight": 10, "width": 64, "height": 64, "num_inference_steps": 4, "fields": own})
    config["warmup_requests"] = 2
    config_path = tmp_path / "benchmark_config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    out = tmp_path / "report"
    result = subprocess.run(
        [sys.executable, "-m", "loadtest.sweep", "--config", str(config_path), "--output", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    points = json.loads((out / "points.json").read_text())
    assert [(point["continuous_batching"], point["batch_size"]) for point in points] == [
        (False, 1),
        (True, 1),
        (False, 4),
        (True, 4),
    ]
    assert all(point["requests"] >= 8 and point["failures"] == 0 and point["meets_sla"] for point in points)
    sent = [row for log in (out / "points").glob("*_requests.csv") for row in csv.DictReader(log.open())]
    own_kind = [row for row in sent if '"scheduler": "euler_a"' in row["name"]]
    assert own_kind and all(row["ok"] == "1" for row in own_kind), "the kind with its own fields was not answered"
    assert points[0]["mean_batch_size"] == 1.0 and points[2]["mean_batch_size"] > 1.0
    assert points[3]["mean_step_images"] > 1.0, "continuous batching with 4 in flight never shared a forward"
    report = (out / "report.md").read_text()
    assert "## Best configuration" in report and "No configuration meets the SLA" not in report
    assert "| continuous | 4 |" in report
    snippet = (out / "model-config-snippet.yaml").read_text()
    assert "continuousBatching:" in snippet and "batchSize:" in snippet
    assert (out / "throughput_vs_p95.png").is_file() and (out / "best_latency_distribution.png").is_file()
