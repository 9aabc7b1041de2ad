"""`make bench-pipeline` in its quick mode (the tiny random model): every variant is measured or
skipped with a reason, and what the report says holds (no timing thresholds)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from PIL import Image

from bench.variants import BASELINE, QUICK_COMPILED, VARIANTS
from server.paths import ROOT

pytestmark = pytest.mark.slow

# SDPA and vanilla attention compute the same softmax(QK^T)V in float32; after rounding to 8 bits an
# image may differ by at most this much per channel value (0-255).
SDPA_TOLERANCE = 1


@pytest.fixture(scope="module")
def report(tmp_path_factory, bench_scratch) -> dict:
    """The quick run, reusing what ``make bench-gpu``'s quick run measured of the same workload
    (when test_bench_gpu.py ran first in this session)."""
    output = tmp_path_factory.mktemp("bench")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.pipeline",
            "--quick",
            "--attention-repeats",
            "1",
            "--output-dir",
            str(output),
            "--name",
            "quick",
            "--scratch",
            str(bench_scratch / "variants"),
        ],
        cwd=ROOT,
        check=True,
        timeout=1800,
    )
    assert (output / "quick.md").is_file()
    with Image.open(output / "quick.png") as chart:
        assert chart.format == "PNG" and chart.width > 800
    return {"json": json.loads((output / "quick.json").read_text()), "markdown": (output / "quick.md").read_text()}


def _variants(report: dict) -> dict[str, dict]:
    return {variant["name"]: variant for variant in report["json"]["variants"]}


def test_every_variant_is_measured_or_skipped_with_its_reason(report):
    variants = _variants(report)
    assert list(variants) == [variant.name for variant in VARIANTS]
    device = torch.device(report["json"]["environment"]["device"])
    assert report["json"]["quick"]
    for variant in VARIANTS:
        result = variants[variant.name]
        reason = variant.skip_reason(device, quick=True)
        if reason:
            assert result == {"name": variant.name, "summary": variant.summary, "status": "skipped", "reason": reason}
            continue
        assert result["status"] == "ok", result
        assert result["latency_s"] > 0 and result["unet_it_s"] > 0 and result["images_per_s"] > 0
        assert result["peak_memory_mib"] >= 0 and result["memory_measure"] == "rss_peak_growth"
        assert result["unet_tflops"] > 0 and "max_abs_diff" in result and "psnr_db" in result
        assert f"| {variant.name} | {result['dtype']} |" in report["markdown"]


def test_sdpa_and_vanilla_attention_give_the_same_image(report):
    variants = _variants(report)
    assert variants[BASELINE]["max_abs_diff"] == 0
    assert variants["sdpa-fp32"]["max_abs_diff"] <= SDPA_TOLERANCE
    assert variants[BASELINE]["unet_call_flops"] > 0


def test_a_compiled_variant_compiles_cold_and_loads_from_the_cache_warm(report):
    compiled = [result for result in _variants(report).values() if result.get("status") == "ok" and "warm" in result]
    assert {result["name"] for result in compiled} == {QUICK_COMPILED}
    for result in compiled:
        cold, warm = result["compile_counters"], result["warm"]["compile_counters"]
        assert cold["fxgraph_cache_miss"] > 0 and cold.get("fxgraph_cache_hit", 0) == 0, result["name"]
        assert warm["fxgraph_cache_hit"] == cold["fxgraph_cache_miss"] and warm.get("fxgraph_cache_miss", 0) == 0, (
            result["name"]
        )
        assert result["max_abs_diff"] <= SDPA_TOLERANCE, result["name"]


def test_attention_micro_benchmark_at_sd15_shapes(report):
    rows = {row["case"]: row for row in report["json"]["attention"]}
    assert set(rows) == {"self-attention 4096x4096", "cross-attention 4096x77"}
    self_attention = rows["self-attention 4096x4096"]
    assert self_attention["score_matrix_mib"] == 1024  # 2 x 8 x 4096 x 4096 float32
    assert self_attention["max_abs_diff"] < 1e-5 and rows["cross-attention 4096x77"]["max_abs_diff"] < 1e-5
    # Vanilla attention materializes the score matrix; SDPA never holds it whole.
    assert self_attention["vanilla"]["peak_memory_mib"] >= self_attention["score_matrix_mib"]
    assert self_attention["sdpa"]["peak_memory_mib"] < self_attention["score_matrix_mib"] / 4
