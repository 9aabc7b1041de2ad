"""The benchmarks' pure parts: variants, image distance, FLOP counting, the reports, the serving
overhead's breakdown."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from diffusers import UNet2DConditionModel
from diffusers.models.attention_processor import AttnProcessor
from torch.utils.flop_counter import FlopCounterMode

from bench import overhead, sd15, sdxl, single_file
from bench.measure import Workload, first_step_path, unet_flops
from bench.pipeline import Runner, image_distance, to_reference
from bench.report import markdown
from bench.variants import BASELINE, VARIANT_NAMES, VARIANTS, by_name, select
from handler.config import HandlerSettings
from handler.families import family_of
from server.archive import BATCH_DELAY_MS
from server.paths import RANDOM_MODEL_DIR


def test_every_variant_is_valid_handler_settings_and_differs_from_the_baseline():
    base = HandlerSettings(model_path="model")
    settings = {variant.name: variant.settings(base) for variant in VARIANTS}
    assert settings[BASELINE].attention == "vanilla" and settings[BASELINE].dtype == "float32"
    assert len({value.model_dump_json() for value in settings.values()}) == len(VARIANTS)
    compiled = {name for name, value in settings.items() if value.compile.enabled}
    assert compiled == {
        "compile-default",
        "compile-reduce-overhead",
        "compile-max-autotune",
        "compile-max-autotune-no-cudagraphs",
        "cudagraphs",
        "cudagraphs-channels-last",
    }
    by_inductor = compiled - {"cudagraphs", "cudagraphs-channels-last"}
    assert {settings[name].compile.mode for name in by_inductor} == {
        name.removeprefix("compile-") for name in by_inductor
    }
    assert settings["cudagraphs"].compile.backend == "cudagraphs" and not settings["cudagraphs"].compile.decoder
    assert settings["cudagraphs-channels-last"].compile.backend == "cudagraphs"
    assert settings["cudagraphs-channels-last"].channels_last and not settings["cudagraphs"].channels_last


def test_on_a_cpu_only_the_cuda_graph_variants_are_skipped_and_say_why():
    skipped = {variant.name: variant.skip_reason(torch.device("cpu")) for variant in VARIANTS}
    assert {name for name, reason in skipped.items() if reason} == {
        "compile-reduce-overhead",
        "compile-max-autotune-no-cudagraphs",
        "cudagraphs",
        "cudagraphs-channels-last",
    }
    assert (
        skipped["compile-reduce-overhead"]
        == skipped["cudagraphs"]
        == skipped["cudagraphs-channels-last"]
        == "CUDA only"
    )
    quick = {variant.name for variant in VARIANTS if variant.skip_reason(torch.device("cpu"), quick=True)}
    assert quick == {
        "compile-reduce-overhead",
        "compile-max-autotune",
        "compile-max-autotune-no-cudagraphs",
        "cudagraphs",
        "cudagraphs-channels-last",
    }


def test_selection_keeps_catalogue_order_and_always_the_baseline():
    assert [variant.name for variant in select(["vae-tiling", "sdpa-fp32"])] == [BASELINE, "sdpa-fp32", "vae-tiling"]
    assert [variant.name for variant in select(None)] == list(VARIANT_NAMES)
    with pytest.raises(ValueError, match="unknown variant\\(s\\) flash.*choose from vanilla-fp32"):
        select(["flash"])


def test_workload_gives_every_variant_the_same_prompts_and_seeds():
    workload = Workload("model", "cpu", 64, 64, 2, 6, 1)
    specs = workload.specs()
    assert [spec.seeds for spec in specs] == [(index,) for index in range(6)]
    assert specs[0].prompt == specs[4].prompt != specs[1].prompt
    assert {spec.num_inference_steps for spec in specs} == {2} and workload.specs(3, steps=5)[
        2
    ].num_inference_steps == 5


MEASURED = {"status": "ok", "latency_s": 1.0, "warmup_overhead_s": 2.0, "first_call_s": 3.0, "compile_counters": {}}


def test_a_runner_reuses_what_its_scratch_holds_for_the_same_workload_only(tmp_path, monkeypatch):
    workload = Workload(str(RANDOM_MODEL_DIR), "cpu", 64, 64, 1, 1, 1)
    measured: list[tuple[str, str]] = []

    def measure(self, variant, run, env, extra):  # what bench.measure leaves in the scratch, recorded
        measured.append((variant.name, run))
        (self.scratch / f"{variant.name}.npy").write_bytes(b"")
        result = {**MEASURED, **({"unet_call_flops": 5} if "--count-flops" in extra else {})}
        (self.scratch / f"{variant.name}-{run}.json").write_text(json.dumps(result))
        return result

    monkeypatch.setattr(Runner, "measure", measure)
    cpu, eager, compiled = torch.device("cpu"), by_name("eager"), by_name("compile-default")
    first = Runner(workload, tmp_path, 60, baseline="vanilla")  # bench-gpu's run measures these
    first.variant(eager, cpu)
    first.variant(compiled, cpu)
    assert measured == [("eager", "cold"), ("compile-default", "cold"), ("compile-default", "warm")]
    measured.clear()
    again = Runner(workload, tmp_path, 60, reuse=True)  # the pipeline bench's, on the same workload
    assert again.variant(compiled, cpu)["warm"]["latency_s"] == 1.0 and again.variant(eager, cpu)["status"] == "ok"
    assert measured == []
    again.variant(by_name("vanilla"), cpu)
    assert measured == [("vanilla", "cold")], "a variant the scratch lacks is measured"
    measured.clear()
    as_baseline = Runner(workload, tmp_path, 60, baseline="eager", reuse=True)
    as_baseline.variant(eager, cpu)
    assert measured == [("eager", "cold")], "a result without the FLOP count its baseline role needs is not reused"
    measured.clear()
    Runner(Workload(str(RANDOM_MODEL_DIR), "cpu", 64, 64, 2, 1, 1), tmp_path, 60, reuse=True).variant(eager, cpu)
    assert measured == [("eager", "cold")], "another workload's results are not reused"


def test_to_reference_gives_the_first_steps_distance_where_both_saved_one(tmp_path):
    images = np.zeros((1, 8, 8, 3), dtype=np.uint8)
    step = np.ones((1, 4, 2, 2), dtype=np.float32)
    for name in ("reference", "near", "old"):
        np.save(tmp_path / f"{name}.npy", images)
    np.save(first_step_path(tmp_path / "reference.npy"), step)
    np.save(first_step_path(tmp_path / "near.npy"), step * 1.001)
    results = {name: {"status": "ok"} for name in ("reference", "near", "old")}
    distances = to_reference(results, tmp_path, "reference")
    assert distances["reference"]["first_step_rel_diff"] == 0
    assert distances["near"]["first_step_rel_diff"] == pytest.approx(0.001, rel=1e-3)
    assert "first_step_rel_diff" not in distances["old"] and distances["old"]["psnr_db"] is None
    np.save(first_step_path(tmp_path / "reference.npy"), step * 0)  # a reference that did not move
    assert to_reference(results, tmp_path, "reference")["near"]["first_step_rel_diff"] is None


def test_image_distance_is_zero_for_identical_images_and_psnr_otherwise():
    images = np.zeros((2, 8, 8, 3), dtype=np.uint8)
    assert image_distance(images, images.copy()) == {"max_abs_diff": 0, "psnr_db": None}
    changed = images.copy()
    changed[1, 3, 3, 0] = 3
    distance = image_distance(changed, images)
    assert distance["max_abs_diff"] == 3
    assert distance["psnr_db"] == pytest.approx(10 * math.log10(255**2 / (9 / images.size)))


def test_meta_device_flop_count_equals_the_count_on_real_weights():
    config = UNet2DConditionModel.load_config(RANDOM_MODEL_DIR / "unet")
    unet = UNet2DConditionModel.from_config(config)
    unet.set_attn_processor(AttnProcessor())
    with FlopCounterMode(display=False) as counter, torch.inference_mode():
        unet(torch.randn(2, 4, 8, 8), torch.zeros(2), torch.randn(2, 77, 32))
    assert counter.get_total_flops() > 0
    assert unet_flops(config, 2, 8, 8, 77) == counter.get_total_flops()


@pytest.mark.parametrize(
    "architecture, latent, teraflops", [(sd15, 64, 1.6065), (sdxl, 128, 13.522)], ids=["sd15", "sdxl"]
)
def test_unet_flops_with_guidance_at_the_published_size(architecture, latent, teraflops):
    """512x512 (SD 1.5) and 1024x1024 (SDXL, its pooled text embedding and time ids counted in), counted
    once here so docs/performance.md can quote them; the parameter counts are checked below."""
    with torch.device("meta"):
        unet = architecture.build_unet()
    assert unet_flops(unet.config, 2, latent, latent, 77) / 1e12 == pytest.approx(teraflops, abs=1e-3)


@pytest.mark.parametrize(
    "architecture, family, scheduler, unet_parameters, text_parameters",
    [
        (sd15, "SD 1.x", "DDIMScheduler", 859_520_964, 123_060_480),
        (sdxl, "SDXL", "EulerDiscreteScheduler", 2_567_463_684, 123_060_480 + 694_659_840),
    ],
)
def test_random_weight_architectures_build_the_published_pipelines(
    monkeypatch, architecture, family, scheduler, unet_parameters, text_parameters
):
    """Built on the meta device (shapes, no weights): the pipeline make bench-gpu writes, of the family the
    handler detects."""
    scheduler_class = getattr(architecture, scheduler)

    def scheduler_on_cpu(**config):  # a scheduler keeps its tables on the CPU, which the meta device refuses
        with torch.device("cpu"):
            return scheduler_class(**config)

    monkeypatch.setattr(architecture, scheduler, scheduler_on_cpu)
    with torch.device("meta"):
        pipeline = architecture.build_pipeline()
    assert sum(parameter.numel() for parameter in pipeline.unet.parameters()) == unet_parameters
    encoders = [pipeline.text_encoder] + ([pipeline.text_encoder_2] if family == "SDXL" else [])
    assert sum(parameter.numel() for encoder in encoders for parameter in encoder.parameters()) == text_parameters
    assert family_of(pipeline, torch.device("cpu"), torch.float16).name == family


def test_markdown_has_one_full_row_per_variant_whatever_its_status():
    ok = {
        "name": BASELINE,
        "status": "ok",
        "dtype": "float32",
        "latency_s": 0.5,
        "speedup": 1.0,
        "images_per_s": 2.0,
        "unet_it_s": 50.0,
        "peak_memory_mib": 3.2,
        "memory_measure": "rss_peak_growth",
        "max_abs_diff": 0,
        "psnr_db": None,
        "warmup_overhead_s": 0.1,
        "unet_call_flops": 1e9,
    }
    report = {
        "model": "tiny",
        "baseline": BASELINE,
        "workload": {
            "width": 64,
            "height": 64,
            "steps": 2,
            "scheduler": "ddim",
            "batch": 1,
            "guidance_scale": 7.5,
            "repeats": 1,
        },
        "environment": {"device_name": "cpu", "date": "2026-11-23", "torch": "2.13.0", "diffusers": "0.42.1"},
        "variants": [
            ok,
            {"name": "compile-reduce-overhead", "status": "skipped", "reason": "CUDA only"},
            {"name": "sdpa-fp16", "status": "failed", "error": "RuntimeError: boom"},
        ],
        "attention": [],
    }
    table = [line for line in markdown(report).splitlines() if line.startswith("| ")]
    assert [line.count("|") for line in table[:4]] == [14] * 4
    assert "| vanilla-fp32 | float32 | 0.500 | 1.00x |" in table[2] and "identical" in table[2]
    assert "skipped: CUDA only" in table[3] and "failed: RuntimeError: boom" in table[4]
    assert "1.000 GFLOP" in markdown(report)


def test_engine_overhead_table_states_the_ratio_per_family_and_batch():
    from bench.engine import Row
    from bench.engine import markdown as engine_markdown

    rows = [
        Row("sd1", "shapes-sd", 1, 64, 25, 0.200, 0.210, 0, 0),
        Row("sdxl", "tiny-sdxl", 8, 64, 25, 0.400, 0.380, 1, 2),
    ]
    table = engine_markdown(
        rows, {"device_name": "cpu", "torch": "2.13.0", "diffusers": "0.42.1", "date": "2026-11-23"}
    )
    assert "| sd1 | shapes-sd | 1 | 64x64 | 25 | 0.2000 | 0.2100 | 1.050x | 0 | 0 | eager |" in table
    assert "| sdxl | tiny-sdxl | 8 | 64x64 | 25 | 0.4000 | 0.3800 | 0.950x | 1 | 2 | eager |" in table


def _overhead_result(client_ms: float, frontend_ms: float, worker_ms: float, local_ms: float) -> dict:
    service = {"service": 0.0, "steps": 0.0, "decode": 0.0, "encode": 0.001}
    return {
        "in_process_median_s": local_ms / 1000,
        "http_median_s": client_ms / 1000,
        "paired_difference_median_s": (client_ms - local_ms) / 1000,
        "ping_median_s": 0.002,
        "mean_s": {"client": client_ms / 1000, "frontend": frontend_ms / 1000, "in_process": local_ms / 1000},
        "worker": {**service, "service": worker_ms / 1000},
        "in_process": {**service, "service": local_ms / 1000},
        "cpu_s_per_request": {"frontend": 0.02, "worker": 0.2, "in_process": 0.18},
    }


def test_overhead_breakdown_takes_each_part_from_its_own_clocks_and_the_table_shows_every_registration(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(overhead, "visible_gpus", lambda: 0)  # a CPU host: one worker, continuous batching
    result = _overhead_result(client_ms=100.0, frontend_ms=95.0, worker_ms=91.0, local_ms=88.0)
    # Each part differs from the others, so a part read from the wrong clock shows.
    assert overhead.breakdown(result) == pytest.approx(
        {
            "service in-process": 0.088,
            "service in the worker, beyond in-process": 0.003,
            "TorchServe: queue, batching wait, frontend, socket, worker loop": 0.004,
            "HTTP: client, connection, frontend before its timer starts": 0.005,
        }
    )
    registrations = overhead.registrations()
    assert [entry.batch_size for entry in registrations][0] == 1
    shipped = registrations[1]
    assert shipped.label.startswith("shipped") and shipped.delay_ms == BATCH_DELAY_MS["continuous"]
    assert registrations[2].delay_ms == overhead.BEFORE_DELAY_MS
    report = {
        "date": "2026-11-27 01:00 UTC",
        "machine": "2 CPUs",
        "request": overhead.REQUEST,
        "repeats": 3,
        "registrations": [{**vars(entry), "result": result} for entry in registrations],
        "native_json_median_s": 0.1,
        "openai_median_s": 0.101,
    }
    text = overhead.table(report)
    for entry in registrations:
        assert f"| {entry.label} | 88.0 | 100.0 | 12.0 | 1.14x |" in text
    assert "| client, total | 100.0 | 100.0 | 100.0 |" in text and "= 1.01x (+1.0 ms)" in text
    assert "| TorchServe's floor: GET /ping round trip, median | 2.0 | 2.0 | 2.0 |" in text
    overhead.plot(report, tmp_path / "overhead.png")
    assert (tmp_path / "overhead.png").stat().st_size > 0
    monkeypatch.setattr(overhead, "visible_gpus", lambda: 4)  # four workers: dynamic batching, already 50 ms
    assert [entry.delay_ms for entry in overhead.registrations()] == [0, BATCH_DELAY_MS["dynamic"]]


def test_the_worker_profile_names_each_sample_by_the_first_part_its_stack_holds():
    loop = "<module> (/v/ts/model_service_worker.py:301);handle_connection (/v/ts/model_service_worker.py:187)"
    handle = f"{loop};predict (/v/ts/service.py:130);handle (/tmp/models/a1/sd_handler.py:190)"
    archive = "/tmp/models/a1/handler"
    step = f"{handle};iterate ({archive}/service/loops.py:160);step ({archive}/engine/step_engine.py:160)"
    collapsed = "\n".join(
        [
            f"{step};forward (/v/torch/nn/modules/conv.py:554) 60",
            f"{step};_stepped ({archive}/service/stepping.py:130);_record ({archive}/metrics.py:214) 5",
            f"{handle};admit ({archive}/service/admission.py:70) 20",
            f"{handle};to_incoming (/tmp/models/a1/sd_handler.py:80) 5",
            f"{loop} 10",
        ]
    )
    shares = overhead.profile_shares(collapsed)
    assert shares["denoising steps"] == 0.6 and shares["metric records (log lines TorchServe parses)"] == 0.05
    assert shares["admission: validation, prompt encoding"] == 0.2 and shares["the handler, other"] == 0.05
    assert shares[overhead.WORKER_LOOP] == 0.1 and sum(shares.values()) == pytest.approx(1.0)
    assert overhead.profile_shares("") == {}


def test_the_suite_time_is_summed_per_test_file_and_tabled(tmp_path):
    from bench.suite_time import run_seconds, seconds_per_file, table

    def report(path, cases):
        rows = "".join(f'<testcase classname="{name}" name="t" time="{seconds}"/>' for name, seconds in cases)
        path.write_text(f'<testsuites><testsuite name="pytest" time="{len(cases)}.5">{rows}</testsuite></testsuites>')
        return path

    before = seconds_per_file(
        report(
            tmp_path / "before.xml",
            [("tests.unit.test_a", 1.5), ("tests.unit.test_a.TestGroup", 2.0), ("tests.integration.test_b", 9.0)],
        )
    )
    after = seconds_per_file(report(tmp_path / "after.xml", [("tests.integration.test_b", 4.0)]))
    assert before == {"unit/test_a.py": 3.5, "integration/test_b.py": 9.0}
    text = table(before, after, top=1)
    assert "| `integration/test_b.py` | 9 | 4 |" in text
    assert "| the other 1 files | 4 | 0 |" in text and "| **all** | **12** | **4** |" in text
    runs = (run_seconds(tmp_path / "before.xml"), run_seconds(tmp_path / "after.xml"))
    assert runs == (3.5, 1.5) and "| **the run, wall clock** | **4** | **2** |" in table(before, after, 1, runs)


def test_the_single_file_benchmark_tables_and_plots_its_rows(tmp_path):
    row = {
        "model": "sd15",
        "file_bytes": 2_132_625_150,
        "single_file_s": 1.0245,
        "directory_s": 1.0283,
        "ratio": 0.996,
        "weights_differing": [],
        "image_max_difference": 0,
    }
    text = single_file.table([row], {"device_name": "a CPU"})
    assert "| sd15 | 2.13 | 1.02 | 1.03 | 1.00x | 0 | 0 |" in text and "(a CPU, float32)" in text
    single_file.plot([row])(tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes().startswith(b"\x89PNG")
