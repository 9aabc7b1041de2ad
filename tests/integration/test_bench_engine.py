"""`make bench-engine` in its quick mode: every family measured against diffusers' own call, with
the images compared (no timing thresholds)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from PIL import Image

from bench.engine import FAMILY_MODELS
from server.paths import ROOT

pytestmark = pytest.mark.slow


def test_quick_engine_benchmark_measures_every_family_and_gets_diffusers_images(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "bench.engine", "--quick", "--output-dir", str(tmp_path)],
        cwd=ROOT,
        check=True,
        timeout=900,
    )
    report = json.loads((tmp_path / "engine.json").read_text())
    assert [(row["family"], row["batch"]) for row in report["rows"]] == [
        (family, batch) for family in FAMILY_MODELS for batch in (1, 2)
    ]
    assert all(row["diffusers_s"] > 0 and row["engine_s"] > 0 and row["max_abs_diff"] <= 1 for row in report["rows"])
    assert all(row["diffusers_batch_diff"] <= 1 for row in report["rows"])  # two steps: rounding stays small
    assert "| engine / diffusers |" in (tmp_path / "engine.md").read_text()
    with Image.open(tmp_path / "engine.png") as chart:
        assert chart.format == "PNG"
