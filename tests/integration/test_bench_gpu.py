"""`make bench-gpu` in its quick mode (CPU, tiny models, one step): every section runs the code the
GPU run will, through the make target, and its report holds what it measured (no timing thresholds)."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
from PIL import Image

from bench.gpu import FULL, QUICK, SECTION_VARIANTS, SECTIONS, SERVED_MODES
from server.paths import ROOT

pytestmark = pytest.mark.slow

CUDA_ONLY = {"compile-max-autotune-no-cudagraphs", "compile-reduce-overhead", "cudagraphs", "cudagraphs-channels-last"}


@pytest.fixture(scope="module")
def report(tmp_path_factory, bench_scratch) -> dict:
    output = tmp_path_factory.mktemp("gpu-report")
    subprocess.run(
        [
            "make",
            "--no-print-directory",
            "bench-gpu",
            f"BENCH_ARGS=--quick --output-dir {output} --scratch {bench_scratch}",
        ],
        cwd=ROOT,
        check=True,
        timeout=1800,
    )
    with Image.open(output / "gpu.png") as plot:
        assert plot.format == "PNG" and plot.width > 1000
    with Image.open(output / "gpu-cache.png") as plot:
        assert plot.format == "PNG"
    return {
        "markdown": (output / "gpu.md").read_text(),
        **{section: json.loads((output / f"{section}.json").read_text()) for section in SECTIONS},
    }


def test_every_section_records_where_it_ran(report):
    for section in SECTIONS:
        assert report[section]["section"] == section and report[section]["status"] == "ok"
        assert report[section]["environment"]["device"] == "cpu"
        assert report[section]["plan"]["steps"] == QUICK.steps
    assert "## Goals" in report["markdown"] and "Measured on a CPU" in report["markdown"]
    for heading in (
        "## 1. SD 1.5 variants",
        "## 2. Batch scaling",
        "## 3. Step engine",
        "## 4. Served",
        "## 5. SDXL",
        "## 6. SD 3.5",
        "## 7. SD 3.5",
        "## 9. ControlNets",
    ):
        assert heading in report["markdown"]


def test_variants_are_measured_against_eager_or_skipped_as_cuda_only(report):
    rows = {row["name"]: row for row in report["variants"]["variants"]}
    assert list(rows) == list(SECTION_VARIANTS)
    for name, row in rows.items():
        if name in CUDA_ONLY:
            assert row["status"] == "skipped" and row["reason"] == "CUDA only"
            continue
        assert row["status"] == "ok", row
        assert row["unet_it_s"] > 0 and row["images_per_s"] > 0 and row["max_abs_diff"] <= 1, name
    assert rows["eager"]["max_abs_diff"] == 0 and rows["eager"]["unet_call_flops"] > 0
    profile = rows["eager"]["profile"]
    assert (
        profile["wall_s"] > 0
        and profile["latency_s"] == rows["eager"]["latency_s"]
        and profile["top_operators"]
        and all(op["seconds"] > 0 for op in profile["top_operators"])
    )
    compiled = rows["compile-default"]
    assert "compile=default(unet,vae_decoder)" in compiled["description"]  # what a worker compiles
    assert compiled["compile_counters"]["fxgraph_cache_miss"] > 0
    assert compiled["warm"]["compile_counters"].get("fxgraph_cache_miss", 0) == 0


def test_scaling_measures_eager_and_the_fastest_compile_mode_at_every_batch(report):
    scaling = report["scaling"]
    assert scaling["compiled"] == "compile-default"  # the only compile mode a CPU runs
    assert [(row["variant"], row["batch"]) for row in scaling["rows"]] == [
        (name, batch) for name in ("eager", "compile-default") for batch in QUICK.batches
    ]
    assert all(row["status"] == "ok" and row["images_per_s"] > 0 for row in scaling["rows"])
    # batch 1 is the variants section's workload: its rows come from there, not measured again
    variants = {row["name"]: row for row in report["variants"]["variants"]}
    for row in (row for row in scaling["rows"] if row["batch"] == 1):
        assert row["latency_s"] == variants[row["variant"]]["latency_s"], row["variant"]


def test_engine_matches_diffusers_images(report):
    rows = report["engine"]["rows"]
    assert [row["batch"] for row in rows] == list(QUICK.engine_batches)
    assert all(row["max_abs_diff"] <= 1 and row["ratio"] > 0 for row in rows)


def test_served_points_in_both_modes_have_no_errors_and_a_ceiling(report):
    served = report["served"]
    assert served["settings"] == {}  # as shipped
    points = [(point["mode"], point["concurrency"]) for point in served["points"]]
    assert points == [(mode, concurrency) for mode in SERVED_MODES for concurrency in QUICK.concurrency]
    for point in served["points"]:
        assert point["errors"] == 0 and point["requests"] == point["concurrency"] * QUICK.requests_per_client
        assert point["images_per_s"] > 0 and point["p50_s"] <= point["p95_s"]
        assert point["ratio"] == pytest.approx(point["images_per_s"] / point["ceiling_images_per_s"])
        assert 1 <= point["mean_step_images"] <= point["concurrency"]  # the server's own figure, from its metrics
        # its steps' and decodes' shares of the point's time (the server's sums), one after the other on a CPU
        assert point["step_share"] > 0 and point["decode_share"] > 0
        assert point["step_share"] + point["decode_share"] < 1.2, "more than the point's time (metrics of another)"
    eager = next(row for row in report["variants"]["variants"] if row["name"] == "eager")
    assert served["ceiling_images_per_s"]["1"] == eager["images_per_s"], "batch 1 is the variants section's eager"
    # the worker's own profile of its first served forwards (handler.profiler), per mode
    assert list(served["profiles"]) == list(SERVED_MODES)
    for mode, profiled in served["profiles"].items():
        assert profiled["steps"] == QUICK.served_profile_steps and profiled["rows_per_step"] >= 2, mode
        assert profiled["measure"] == "self CPU time" and profiled["top_operators"] and profiled["device"] == "cpu"
        assert (
            f"The served step, {mode} batching: a window of {QUICK.served_profile_steps} forwards" in report["markdown"]
        )


def test_sdxl_runs_eager_and_float32_and_the_full_plan_also_compiled(report, bench_scratch):
    section = report["sdxl"]
    rows = {row["name"]: row for row in section["variants"]}
    assert list(rows) == ["eager", "sdpa-fp32"] and not QUICK.sdxl_compiled and FULL.sdxl_compiled
    assert all(row["status"] == "ok" and row["unet_it_s"] > 0 for row in rows.values())
    assert rows["eager"]["unet_call_flops"] > 0  # SDXL's UNet counted with its added conditioning
    # on the CPU eager runs float32 too: the same image as the reference
    assert section["reference"] == "sdpa-fp32" and set(section["to_reference"]) == set(rows)
    assert section["to_reference"]["eager"]["max_abs_diff"] <= 1
    # and so is its first step (one forward's latent change), which later steps have not amplified
    assert section["to_reference"]["eager"]["first_step_rel_diff"] < 1e-5
    assert section["to_reference"]["sdpa-fp32"]["first_step_rel_diff"] == 0
    moved = np.load(bench_scratch / "sdxl" / "eager-first-step.npy")  # what the step moved: not nothing
    assert moved.shape[0] == 1 and np.abs(moved).max() > 0
    assert "Against the same call in float32 (`sdpa-fp32`): eager, " in report["markdown"]


def test_sd35_runs_in_process_at_each_batch_and_served_with_continuous_batching(report):
    rows = report["sd35"]["rows"]
    assert [(row["batch"], row["status"]) for row in rows] == [(batch, "ok") for batch in QUICK.sd35_batches]
    assert all(row["unet_it_s"] > 0 and row["workload"]["scheduler"] == "flow_match_euler" for row in rows)
    assert rows[0]["unet_call_flops"] > 0  # the SD 3 transformer counted with CLIP's and T5's tokens
    assert "family=SD 3.x" in rows[0]["description"]
    points = report["sd35_served"]["points"]
    assert [(point["mode"], point["concurrency"]) for point in points] == [
        ("continuous", concurrency) for concurrency in QUICK.sd35_batches
    ]
    ceilings = {row["batch"]: row["images_per_s"] for row in rows}
    for point in points:
        assert point["errors"] == 0 and point["images_per_s"] > 0
        assert point["ceiling_images_per_s"] == ceilings[point["concurrency"]], "the ceiling is sd35's own figure"


def test_lora_measures_every_design_against_no_lora_and_says_what_auto_took(report):
    section = report["lora"]
    assert section["status"] == "ok" and section["side"] == QUICK.lora_side and section["rank"] == QUICK.lora_rank
    cases = {(row["workload"], row["design"]) for row in section["rows"]}
    workloads = ("one LoRA, all 8", "8 different LoRAs", "8 sets of 3 LoRAs")
    compiled = ("compiled", "compiled-stacked")  # the compiled denoiser's slots, gathered and stacked
    assert cases == {("no LoRA", d) for d in ("auto", *compiled)} | {
        (w, d) for w in workloads for d in ("grouped", "segments", "stacked", "auto", *compiled)
    }
    assert section["graphs_compiled_after_warm_up"] == 0, "a LoRA set changing recompiled the denoiser"
    assert section["compile_backend"] == QUICK.lora_compile_backend == "cudagraphs"
    assert all(row["ratio"] > 0 and row["median_s"] > 0 for row in section["rows"])
    assert set(section["auto_designs"]) == set(workloads)
    assert "## 8. LoRA sets in one SD 1.5 forward, per design" in report["markdown"]
    assert "LoRA layer forwards stacked" in report["markdown"]
    assert "compiled (LoRA slots, cudagraphs), no LoRA:" in report["markdown"]


def test_controlnet_times_the_shared_forward_against_grouped_with_the_forwards_each_took(report):
    section = report["controlnet"]
    assert section["status"] == "ok" and section["side"] == QUICK.controlnet_side
    forwards = {(row["workload"], row["design"]): tuple(row["forwards"]) for row in section["rows"]}
    assert forwards[("4 with one, 4 with another", "shared")] == (1, 2)
    assert forwards[("4 with one, 4 with another", "grouped")] == (2, 2)
    assert all(row["ratio"] > 0 and row["median_s"] > 0 for row in section["rows"])
    assert "## 9. ControlNets in one SD 1.5 forward" in report["markdown"]


def test_cache_times_deepcache_on_sd15_and_first_block_on_sd35_against_no_cache(report):
    section = report["cache"]
    assert section["status"] == "ok"
    (deep, first_block) = section["results"]
    assert (deep["side"], deep["steps"], first_block["side"]) == (
        QUICK.cache_side,
        QUICK.cache_steps,
        QUICK.cache_sd35_side,
    )
    assert [row["workload"] for row in first_block["rows"]][1] == "all 8 at threshold 0.3"
    for result in (deep, first_block):
        assert all(row["images_per_s"] > 0 and row["ratio"] > 0 for row in result["rows"])
        assert result["rows"][1]["cached_share"] > 0, f"{result['model']}: no step reused its cache"
    assert "## 10. Step caching per request" in report["markdown"] and "| all 8 at interval 3 |" in report["markdown"]
