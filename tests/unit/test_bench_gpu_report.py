"""`make bench-gpu`'s report from section files: goals and where each figure stands, partial runs,
failed rows, what a failed section keeps (pure logic; the quick run itself is
tests/integration/test_bench_gpu.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from bench import gpu
from bench.gpu import EAGER, QUICK, SECTIONS, SERVED_MODES, GpuBench, parse_args, row_key, served_config
from bench.gpu_report import goals, markdown, render
from bench.pipeline import Runner
from handler.config import HandlerSettings
from server.paths import MODEL_CONFIG

ENVIRONMENT = {
    "device": "cuda:0",
    "device_name": "NVIDIA H100 80GB HBM3",
    "driver": "580.159.04",
    "cuda": "13.0",
    "torch": "2.11.0+cu130",
    "diffusers": "0.42.1",
    "python": "3.12.3",
    "date": "2026-11-24",
}
WORKLOAD = {
    "model_dir": "/repo/models/sd15-random",
    "width": 512,
    "height": 512,
    "steps": 50,
    "scheduler": "ddim",
    "batch": 1,
    "guidance_scale": 7.5,
    "repeats": 3,
}


def _variant(name: str, unet_it_s: float, **extra) -> dict:
    return {
        "name": name,
        "status": "ok",
        "dtype": "float16",
        "latency_s": 50 / unet_it_s,
        "images_per_s": unet_it_s / 50,
        "unet_it_s": unet_it_s,
        "peak_memory_mib": 3000.0,
        "memory_measure": "cuda_max_allocated",
        "warmup_overhead_s": 1.0,
        "max_abs_diff": 0,
        "psnr_db": None,
        **extra,
    }


def _sections() -> dict:
    return {
        "variants": {
            "environment": ENVIRONMENT,
            "workload": WORKLOAD,
            "variants": [
                _variant(
                    "eager",
                    55.0,
                    profile={
                        "wall_s": 1.2,
                        "latency_s": 0.9,
                        "measure": "kernel time",
                        "device_busy_s": 0.81,
                        "device_busy_fraction": 0.9,
                        "host_syncs": {"cudaDeviceSynchronize": 51},
                        "syncs_per_step": 1.02,
                        "launches_per_step": 412.0,
                        "top_operators": [{"name": "sm90_xmma_gemm", "calls": 900, "seconds": 0.3}],
                    },
                ),
                _variant("compile-max-autotune-no-cudagraphs", 110.0),
                {"name": "compile-reduce-overhead", "status": "failed", "error": "RuntimeError: boom"},
            ],
        },
        "served": {
            "environment": ENVIRONMENT,
            "ceiling_images_per_s": {"1": 2.0, "4": 6.0},
            "points": [
                {
                    "mode": "dynamic",
                    "concurrency": 1,
                    "requests": 6,
                    "errors": 0,
                    "images_per_s": 1.9,
                    "p50_s": 0.5,
                    "p95_s": 0.6,
                    "ceiling_images_per_s": 2.0,
                    "ratio": 0.95,
                },
                {
                    "mode": "continuous",
                    "concurrency": 4,
                    "requests": 24,
                    "errors": 1,
                    "images_per_s": 4.8,
                    "p50_s": 0.8,
                    "p95_s": 1.1,
                    "ceiling_images_per_s": 6.0,
                    "ratio": 0.8,
                },
            ],
        },
        "engine": {
            "environment": ENVIRONMENT,
            "rows": [
                {
                    "family": "sd1",
                    "model": "sd15-random",
                    "batch": batch,
                    "side": 512,
                    "steps": 25,
                    "diffusers_s": 1.0,
                    "engine_s": ratio,
                    "max_abs_diff": 1,
                    "diffusers_batch_diff": 1,
                    "ratio": ratio,
                    "engine_it_s": 25 / ratio,
                    "denoiser": denoiser,
                }
                # a compiled engine's ratio to diffusers' eager call is no overhead: the goal reads eager rows only
                for batch, ratio, denoiser in (
                    (1, 1.02, "eager"),
                    (8, 0.99, "eager"),
                    (1, 0.25, "compile-reduce-overhead"),
                )
            ],
        },
    }


def test_goals_take_the_best_unet_and_the_worst_ratios():
    table = "\n".join(goals(_sections()))
    assert (
        "| SD 1.5 UNet, batch 1 (sd15-random, 512x512) | >= 105.0 it/s "
        "| 110.0 it/s (compile-max-autotune-no-cudagraphs) | met |" in table
    )
    assert "| SDXL UNet, batch 1 | >= 21.6 it/s | — | not measured |" in table
    assert "80% at worst (continuous, concurrency 4) | short by 11% |" in table
    assert "1.020x at worst (batch 1) | met |" in table
    assert "| SD 1.5 through the step engine, batch 1 (steps and decode) | >= 105.0 it/s | 100.0 it/s " in table
    assert "(compile-reduce-overhead) | short by 5% |" in table


def test_sdxl_says_how_far_each_image_is_from_float32_and_its_goal_reads_the_serving_dtype():
    sections = {
        "sdxl": {
            "environment": ENVIRONMENT,
            "workload": {**WORKLOAD, "model_dir": "/repo/models/sdxl-random", "width": 1024, "height": 1024},
            "variants": [
                _variant("eager", 17.0),
                _variant("sdpa-fp32", 30.0, dtype="float32", max_abs_diff=220, psnr_db=18.0),  # faster: not the goal's
                _variant("compile-reduce-overhead", 29.3, max_abs_diff=237, psnr_db=17.4),
            ],
            "reference": "sdpa-fp32",
            "to_reference": {
                "eager": {"max_abs_diff": 220, "psnr_db": 18.0, "first_step_rel_diff": 0.0012},
                "sdpa-fp32": {"max_abs_diff": 0, "psnr_db": None, "first_step_rel_diff": 0.0},
                "compile-reduce-overhead": {"max_abs_diff": 230, "psnr_db": 17.9},  # a file from before first steps
            },
        }
    }
    assert "| 29.3 it/s (compile-reduce-overhead) | met |" in "\n".join(goals(sections))
    assert (
        "Against the same call in float32 (`sdpa-fp32`): eager, max abs diff 220, PSNR 18.0 dB, first step 0.0012; "
        "compile-reduce-overhead, max abs diff 230, PSNR 17.9 dB. The images alone cannot tell" in markdown(sections)
    )
    for distance in sections["sdxl"]["to_reference"].values():  # a file from before first steps
        distance.pop("first_step_rel_diff", None)
    assert "compile-reduce-overhead, max abs diff 230, PSNR 17.9 dB.\n" in markdown(sections) + "\n"
    assert "The images alone cannot tell" not in markdown(sections)


def test_markdown_renders_the_sections_present_with_their_environment():
    text = markdown(_sections())
    assert "Measured on a CPU" not in text
    assert "*NVIDIA H100 80GB HBM3, driver 580.159.04, CUDA 13.0, torch 2.11.0+cu130" in text
    assert "the GPU ran kernels 90% of the call (0.810 s); host synchronizations: cudaDeviceSynchronize 51" in text
    assert "per denoising step 1.0 synchronizations and 412 kernel launches (the call's" in text
    assert "| `sm90_xmma_gemm` | 900 | 0.3000 |" in text
    assert "| compile-reduce-overhead | failed: RuntimeError: boom |" in text
    assert "| continuous | 4 | 24 | 1 | 4.80 | 0.80 | 1.10 | 6.00 | 80% | — |" in text
    assert "## 2. Batch scaling" not in text and "## 5. SDXL" not in text


def test_render_writes_markdown_and_a_plot_from_partial_sections(tmp_path):
    for name, section in _sections().items():
        (tmp_path / f"{name}.json").write_text(json.dumps(section))
    markdown_path, plot_path = render(tmp_path)
    assert markdown_path.read_text().startswith("# GPU benchmark")
    with Image.open(plot_path) as plot:
        assert plot.format == "PNG"


def test_a_failed_or_stopped_section_says_so_and_keeps_what_it_measured(tmp_path):
    sections = _sections()
    sections["served"] |= {"status": "failed", "error": "FileNotFoundError: no java on PATH", "points": []}
    sections["variants"]["status"] = "running"
    text = markdown(sections)
    assert "**Failed:** `FileNotFoundError: no java on PATH`" in text
    assert "*Incomplete: the run stopped before this section ended.*" in text and "| eager | float16 |" in text
    for name, section in sections.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(section))
    render(tmp_path)


def test_a_section_that_fails_before_measuring_keeps_no_earlier_runs_figures(tmp_path, monkeypatch):
    """An earlier run's file (perhaps another GPU's) is not relabelled with this run's environment."""
    bench = GpuBench(QUICK, "cpu", tmp_path, tmp_path / "scratch", timeout=60)
    earlier = _sections()["served"]  # another GPU's figures
    (tmp_path / "served.json").write_text(json.dumps({"section": "served", "status": "ok", **earlier}))

    def fails_at_once() -> dict:
        raise FileNotFoundError("no java on PATH")

    monkeypatch.setattr(bench, "served", fails_at_once)
    assert not bench.run("served", None)
    saved = json.loads((tmp_path / "served.json").read_text())
    assert saved["status"] == "failed" and "points" not in saved and "no java" in saved["error"]

    def fails_after_a_point() -> dict:
        bench.save("served", {"points": earlier["points"][:1]})
        raise RuntimeError("worker died")

    monkeypatch.setattr(bench, "served", fails_after_a_point)
    assert not bench.run("served", None)
    saved = json.loads((tmp_path / "served.json").read_text())
    assert saved["points"] == earlier["points"][:1] and saved["environment"] == bench.environment


def test_the_command_line_runs_variants_alone_with_variants_and_the_compile_mode_asked_for(tmp_path):
    """A call of the GPU plan names what it runs: ``--variants`` alone is that section, and
    ``--compiled`` the compile mode scaling and sdxl measure, whatever the output directory holds."""
    assert parse_args(["--variants", "compile-default"]).sections == ["variants"]
    assert parse_args([]).sections == list(SECTIONS)
    assert parse_args(["--sections", "sdxl", "--variants", "channels-last"]).sections == ["sdxl"]
    bench = GpuBench(QUICK, "cpu", tmp_path, tmp_path / "scratch", timeout=60)
    assert bench.best_compiled() == "compile-default"  # no variants.json
    compiled = parse_args(["--compiled", "compile-reduce-overhead"]).compiled
    assert GpuBench(QUICK, "cpu", tmp_path, tmp_path / "scratch", 60, compiled).best_compiled() == compiled


def test_the_served_sections_run_the_handler_settings_asked_for_and_say_which(tmp_path, monkeypatch):
    """``--served-setting KEY=VALUE`` sets the served servers' handler settings (VALUE as YAML, a
    dotted KEY nested into the shipped section; none: as shipped), and the report names them above
    the served table; ``--served-modes`` measures a subset of the batching modes."""
    shipped = parse_args([])
    assert shipped.served_settings == {} and shipped.served_modes == tuple(SERVED_MODES)
    assignments = [
        "decode_stream=own",
        "iteration_budget_ms=25",
        "compile.enabled=true",
        "compile.backend=cudagraphs",
        "compile.pad_rows=off",  # YAML 1.1's false, kept as the word
    ]
    args = parse_args(
        ["--sections", "served", "--served-modes", "continuous", *(f"--served-setting={one}" for one in assignments)]
    )
    compiled = {"enabled": True, "backend": "cudagraphs", "pad_rows": "off"}
    asked = {"decode_stream": "own", "iteration_budget_ms": 25, "compile": compiled}
    assert args.served_settings == asked and args.served_modes == ("continuous",)
    bench = GpuBench(QUICK, "cpu", tmp_path, tmp_path / "scratch", 60, None, args.served_settings, args.served_modes)
    config = yaml.safe_load(
        served_config(tmp_path, QUICK.sd15_model, (1, 2), SERVED_MODES["continuous"], bench.served_settings).read_text()
    )
    shipped_compile = yaml.safe_load(MODEL_CONFIG.read_text())["handler"]["compile"]
    assert config["handler"]["compile"] == {**shipped_compile, **compiled}  # the shipped section's other keys kept
    served = HandlerSettings.from_model_yaml(config)
    assert (served.decode_stream, served.iteration_budget_ms, served.compile.backend) == ("own", 25, "cudagraphs")
    measured = []
    monkeypatch.setattr(GpuBench, "_served", lambda self, section, *rest: measured.append((section, rest[4])))
    bench.served()
    assert measured == [("served", {"continuous": SERVED_MODES["continuous"]})]
    sections = _sections()
    assert "Handler settings as shipped." in markdown(sections)  # figures saved before the option
    sections["served"]["decode_stream"] = "own"
    assert 'Handler settings: `decode_stream="own"`.' in markdown(sections)
    sections["served"]["settings"] = asked
    text = markdown(sections).split("## 4. Served")[1].split("\n## ")[0]
    assert (
        'Handler settings: `decode_stream="own"`, `iteration_budget_ms=25`, `compile.enabled=true`, '
        '`compile.backend="cudagraphs"`, `compile.pad_rows="off"`.' in text
    )


@pytest.mark.parametrize(
    "assignments, says",
    [
        (["decode_stream"], "is not KEY=VALUE"),
        (["=own"], "is not KEY=VALUE"),
        (["decode_stream=side"], "decode_stream"),
        (["iteration_budget_msx=25"], "iteration_budget_msx"),
        (["compile.enabled=maybe"], "compile.enabled"),
        (["compile.enabled.really=true"], "compile.enabled"),
        (["request_timeout_s=400"], "responseTimeout"),  # checked against the model config a worker reads
        (["model_path=/elsewhere"], "the bench sets model_path itself"),
        (["profiler.steps=3"], "the bench sets profiler itself"),
        (["compile=1", "compile.enabled=true"], "compile is set to a value"),
        (["compile.enabled=true", "compile={backend: cudagraphs}"], "set them one by one"),
    ],
)
def test_a_served_setting_the_handler_refuses_stops_the_run_before_it_starts(assignments, says, capsys):
    """A setting no worker would take, or one the bench sets itself, fails the command line, naming
    it, before any section runs."""
    with pytest.raises(SystemExit):
        parse_args(["--served-setting=decode_stream=own", *(f"--served-setting={one}" for one in assignments)])
    error = capsys.readouterr().err
    assert "--served-setting" in error and says in error, error


def test_served_points_say_what_share_of_their_time_steps_and_decodes_took():
    """Each served point shows its steps' and decodes' shares of its time (the server's sums over
    the point's wall time) under a note saying what they count; points measured before they were
    reported show none."""
    sections = _sections()
    served = markdown(sections).split("## 4. Served")[1].split("\n## ")[0]
    assert "steps' share of the time" in served
    assert "The steps' share:" not in served  # no point has them
    sections["served"]["points"][0] |= {"step_share": 0.814, "decode_share": 0.052}
    served = markdown(sections).split("## 4. Served")[1].split("\n## ")[0]
    rows = [line for line in served.splitlines() if line.startswith("| dynamic") or line.startswith("| continuous")]
    assert rows[0].endswith("| 81% | 5% |") and rows[1].endswith("| — | — |")
    assert "The steps' share:" in served and "may overlap" in served


def test_a_row_of_the_variants_section_serves_scaling_unless_it_failed(monkeypatch):
    """The variants section searches the largest batch (``max_batch_limit``) on the workload the
    scaling section's batch 1 measures: its row serves there, not measured twice; a failed one is
    measured again."""
    bench = GpuBench(QUICK, "cpu", Path("/unused"), Path("/unused"), timeout=60)
    measured: list[tuple[int, str]] = []

    class Runner:  # stands in for the measuring processes
        def __init__(self, workload, *args, **kwargs):
            self.workload = workload

        def variant(self, variant, device, warm=True) -> dict:
            measured.append((self.workload.max_batch_limit, variant.name))
            return {"status": "ok", "latency_s": 2.0}

    monkeypatch.setattr(gpu, "Runner", Runner)
    searched = bench.workload(QUICK.sd15_model, 64, 1, max_batch_limit=128)
    bench.rows[(row_key(searched), "eager")] = {"status": "ok", "latency_s": 1.0, "max_batch": 64}
    bench.rows[(row_key(searched), "compile-default")] = {"status": "failed", "error": "timed out after 450 s"}
    plain = bench.workload(QUICK.sd15_model, 64, 1)
    assert bench.row(plain, "eager", "scaling-1")["latency_s"] == 1.0 and measured == []
    assert bench.row(plain, "compile-default", "scaling-1")["latency_s"] == 2.0
    assert bench.row(bench.workload(QUICK.sd15_model, 64, 1, batch=2), "eager", "scaling-2")["latency_s"] == 2.0
    assert measured == [(0, "compile-default"), (0, "eager")]


def test_a_random_weight_model_that_failed_to_build_fails_again_at_once(monkeypatch):
    """SD 3.5 Medium is written by three sections: one failed build (16 GB, minutes) is not
    retried by each, and a name that is not a random-weight model is a directory."""
    builds: list[str] = []

    def fails() -> Path:
        builds.append("sd35")
        raise OSError("No space left on device")

    monkeypatch.setitem(gpu.RANDOM_MODELS, "sd35", fails)
    monkeypatch.setattr(gpu, "BUILD_FAILURES", {})
    gpu.model_dir.cache_clear()
    try:
        with pytest.raises(OSError):
            gpu.model_dir("sd35")
        for _ in range(2):
            with pytest.raises(RuntimeError, match="failed to build earlier") as failed:
                gpu.model_dir("sd35")
            assert isinstance(failed.value.__cause__, OSError)
        assert builds == ["sd35"]
        assert gpu.model_dir("models/tiny-sd") == gpu.ROOT / "models" / "tiny-sd"
    finally:
        gpu.model_dir.cache_clear()


def test_reuse_ceilings_takes_the_ceiling_an_earlier_run_measured_in_the_same_scratch(tmp_path, monkeypatch):
    """``--reuse-ceilings``: a served section's in-process ceiling an earlier run measured in the same
    scratch for the same workload is taken, not measured again; without it, it is measured again."""
    measured = []

    def measure(runner, variant, run, env, extra):
        measured.append(variant.name)
        result = {"status": "ok", "images_per_s": 2.0 + len(measured), "unet_call_flops": 1}
        np.save(runner.scratch / f"{variant.name}.npy", np.zeros(1))
        (runner.scratch / f"{variant.name}-{run}.json").write_text(json.dumps(result))
        return result

    monkeypatch.setattr(Runner, "measure", measure)
    assert not parse_args([]).reuse_ceilings and parse_args(["--reuse-ceilings"]).reuse_ceilings
    scratch = tmp_path / "scratch"
    ceilings = []
    for reuse in (False, True, False):
        bench = GpuBench(QUICK, "cpu", tmp_path, scratch, 60, reuse_ceilings=reuse)
        workload = bench.workload(QUICK.sd15_model, QUICK.side, QUICK.served_steps, 2)
        ceilings.append(bench.row(workload, EAGER, "served-ceiling-2", bench.reuse_ceilings)["images_per_s"])
    assert measured == [EAGER, EAGER] and ceilings == [3.0, 3.0, 4.0]
    sections = _sections()
    sections["served"]["reuse_ceilings"] = True
    assert "(`--reuse-ceilings`)" in markdown(sections).split("## 4. Served")[1].split("\n## ")[0]
