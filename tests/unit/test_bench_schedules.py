"""``make bench-schedules`` on a tiny model: a first job and the next per scheduler and step count,
each scheduler's calls, and its report."""

from __future__ import annotations

import json
import sys

from PIL import Image

from bench import schedules
from server.paths import TINY_MODEL_DIRS


def test_the_benchmark_times_a_schedules_first_job_and_the_next_and_reports_them(tmp_path, monkeypatch):
    arguments = ["--model", str(TINY_MODEL_DIRS["sd2"]), "--schedulers", "lms", "heun", "ddim", "--steps", "3", "5"]
    monkeypatch.setattr(sys, "argv", ["bench.schedules", *arguments, "--output", str(tmp_path)])
    schedules.main()
    report = json.loads((tmp_path / "schedules.json").read_text())
    assert report["family"] == "SD 2.x"
    rows = report["rows"]
    assert [(row["scheduler"], row["steps"]) for row in rows] == [
        (name, steps) for name in ("lms", "heun", "ddim") for steps in (3, 5)
    ]
    calls = {(row["scheduler"], row["steps"]): (row["first"]["calls"], row["next"]["calls"]) for row in rows}
    assert calls[("heun", 5)] == (9, 9) and calls[("lms", 5)] == (5, 5)  # Heun: two calls a step but the first
    assert all(row[job][figure] > 0 for row in rows for job in schedules.JOBS for figure in ("start_ms", "step_ms"))
    assert "| lms | 5 | 5 |" in (tmp_path / "schedules.md").read_text()
    with Image.open(tmp_path / "schedules.png") as plot:
        assert plot.format == "PNG"
