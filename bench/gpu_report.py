"""`make bench-gpu`'s report: ``gpu.md`` and ``gpu.png`` from the section files in one directory,
with where each figure stands against the goals (published H100 figures; the issue's ratios)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench import sd35  # noqa: E402
from bench.cache import plot as cache_plot  # noqa: E402
from bench.cache import table as cache_table  # noqa: E402
from bench.controlnets import table as controlnet_table  # noqa: E402
from bench.engine import GOAL as ENGINE_GOAL  # noqa: E402
from bench.engine import Row, table  # noqa: E402
from bench.report import distance_text, number_text, variants_table  # noqa: E402

SD15_UNET_GOAL = 105.0  # it/s, SD 1.5 512x512 batch 1 on an H100: stable-fast's published 104.6
SD15_ANCHORS = {"plain PyTorch (stable-fast, H100)": 54.5, "torch.compile (stable-fast, H100)": 66.0}
SDXL_UNET_GOAL = 21.6  # it/s, SDXL 1024x1024 batch 1 on an H100: stable-fast's published figure
SERVED_GOAL = 0.90  # served images/s over the in-process ceiling at the same batch
# SD 3.5 Large (8.1B), 1024x1024, 50 steps, batch 1, bf16, torch.compile, on an H100 (ONNX Runtime PR
# #22986): the published anchor next to SD 3.5 Medium's figures.
SD35_LARGE_ANCHOR = (
    "SD 3.5 Large, 1024x1024, 50 steps, batch 1, bf16 with torch.compile, H100: 7.47 s (ONNX Runtime PR #22986)"
)


def load_sections(directory: Path) -> dict[str, dict]:
    return {
        name: json.loads((directory / f"{name}.json").read_text())
        for name in SECTION_RENDERERS
        if (directory / f"{name}.json").is_file()
    }


def _environment_line(section: dict) -> str:
    env = section["environment"]
    driver = f", driver {env['driver']}, CUDA {env['cuda']}" if env.get("driver") else ""
    return (
        f"*{env['device_name']}{driver}, torch {env['torch']}, diffusers {env['diffusers']}, Python {env['python']}, "
        f"{env['date']}*"
    )


def _ok(rows: list[dict]) -> dict[str, dict]:
    return {row["name"]: row for row in rows if row.get("status") == "ok"}


def _serving(section: dict | None) -> dict[str, dict]:
    """A section's measured variants in the serving dtype (not its float32 reference)."""
    measured = _ok((section or {}).get("variants", []))
    measured.pop((section or {}).get("reference"), None)
    return measured


def _standing(value: float | None, goal: float, higher_is_better: bool = True) -> str:
    if value is None:
        return "not measured"
    if (value >= goal) if higher_is_better else (value <= goal):
        return "met"
    return f"short by {abs(value - goal) / goal:.0%}"


def goals(sections: dict[str, dict]) -> list[str]:
    """One row per goal: the best measured figure and where it stands."""
    rows = ["| goal | target | measured | standing |", "| --- | --- | --- | --- |"]

    def best_unet(section: str) -> tuple[float | None, str]:
        measured = _serving(sections.get(section))
        if not measured:
            return None, "—"
        name = max(measured, key=lambda key: measured[key]["unet_it_s"])
        return measured[name]["unet_it_s"], f"{measured[name]['unet_it_s']:.1f} it/s ({name})"

    for section, label, goal in (
        ("variants", "SD 1.5 UNet, batch 1", SD15_UNET_GOAL),
        ("sdxl", "SDXL UNet, batch 1", SDXL_UNET_GOAL),
    ):
        value, text = best_unet(section)
        workload = sections.get(section, {}).get("workload")
        where = f" ({Path(workload['model_dir']).name}, {workload['width']}x{workload['height']})" if workload else ""
        rows.append(f"| {label}{where} | >= {goal} it/s | {text} | {_standing(value, goal)} |")
    alone = [row for row in sections.get("engine", {}).get("rows", []) if row["batch"] == 1 and "engine_it_s" in row]
    fastest = max(alone, key=lambda row: row["engine_it_s"]) if alone else None
    rows.append(
        f"| SD 1.5 through the step engine, batch 1 (steps and decode) | >= {SD15_UNET_GOAL} it/s | "
        + (f"{fastest['engine_it_s']:.1f} it/s ({fastest['denoiser']})" if fastest else "—")
        + f" | {_standing(fastest['engine_it_s'] if fastest else None, SD15_UNET_GOAL)} |"
    )
    points = [
        point
        for section in ("served", "sd35_served")
        for point in sections.get(section, {}).get("points", [])
        if point["ratio"] is not None
    ]
    worst = min(points, key=lambda point: point["ratio"]) if points else None
    rows.append(
        f"| served / in-process images/s, same batch | >= {SERVED_GOAL:.0%} | "
        + (f"{worst['ratio']:.0%} at worst ({worst['mode']}, concurrency {worst['concurrency']})" if worst else "—")
        + f" | {_standing(worst['ratio'] if worst else None, SERVED_GOAL)} |"
    )
    engine = [row for row in sections.get("engine", {}).get("rows", []) if row.get("denoiser", "eager") == "eager"]
    slowest = max(engine, key=lambda row: row["ratio"]) if engine else None
    rows.append(
        f"| step engine / diffusers call, time | <= {ENGINE_GOAL:.2f}x | "
        + (f"{slowest['ratio']:.3f}x at worst (batch {slowest['batch']})" if slowest else "—")
        + f" | {_standing(slowest['ratio'] if slowest else None, ENGINE_GOAL, higher_is_better=False)} |"
    )
    return rows


def _profile_lines(rows: list[dict]) -> list[str]:
    profiled = next((row["profile"] for row in rows if row.get("profile")), None)
    if not profiled:
        return []
    heading = (
        f"Where an eager call's {profiled['latency_s']:.3f} s go (torch.profiler, {profiled['measure']}; "
        f"{profiled['wall_s']:.3f} s while profiled):"
    )
    return _profile_block(
        profiled,
        heading,
        "the call",
        "the step clock adds one event wait per call: CUDA events",
        "the call's, start and decode included",
    )


def _profile_block(profiled: dict, heading: str, whole: str, sync_note: str, launch_note: str) -> list[str]:
    """A profile's kernel share, syncs and launches per step (on CUDA) and its top kernels or operators."""
    lines = ["", heading]
    if "device_busy_fraction" in profiled:
        syncs = ", ".join(f"{name} {count}" for name, count in profiled["host_syncs"].items()) or "none"
        lines.append(
            f"the GPU ran kernels {profiled['device_busy_fraction']:.0%} of {whole} "
            f"({profiled['device_busy_s']:.3f} s); host synchronizations: {syncs} ({sync_note}); "
            f"per denoising step {profiled.get('syncs_per_step', 0):.1f} synchronizations and "
            f"{profiled.get('launches_per_step', 0):.0f} kernel launches ({launch_note})."
        )
    lines += [
        "",
        *_table(
            ["operator" if "device_busy_s" not in profiled else "kernel", "calls", "seconds"],
            [[f"`{op['name'][:80]}`", str(op["calls"]), f"{op['seconds']:.4f}"] for op in profiled["top_operators"]],
        ),
    ]
    return lines


def _served_profiles(section: dict) -> list[str]:
    """The worker's own profile of a window of served forwards, per batching mode (``handler.profiler``)."""
    lines = []
    for mode, profiled in section.get("profiles", {}).items():
        if profiled is None:
            lines += ["", f"The served step, {mode} batching: no profile (no forward reached the window's rows)."]
            continue
        heading = (
            f"The served step, {mode} batching: a window of {profiled['steps']} forwards, "
            f"{profiled['rows_per_step']:.1f} rows each on average, "
            f"in {profiled['wall_s']:.3f} s while profiled, the worker's loop between them included "
            f"(`handler.profiler`, {profiled['measure']}):"
        )
        lines += _profile_block(
            profiled, heading, "the window", "the window's end adds one, to close it", "the window's, decodes included"
        )
    return lines


def _workload_line(workload: dict) -> str:
    return (
        f"`{Path(workload['model_dir']).name}`, {workload['width']}x{workload['height']}, {workload['steps']} "
        f"{workload['scheduler']} steps, batch "
        f"{workload['batch']}, guidance {workload['guidance_scale']}; median of {workload['repeats']} calls after a "
        "warm-up call; compile cold/warm: the first call's extra time with an empty and with a persisted inductor "
        "cache. "
        "The step engine's steps are timed with CUDA events, without a synchronization in the step, as the "
        "service's per-step metrics are (`handler/engine/timing.py`)."
    )


def markdown(sections: dict[str, dict]) -> str:
    lines = ["# GPU benchmark (`make bench-gpu`)", "", "## Goals", ""]
    if any(section["environment"]["device"] == "cpu" for section in sections.values()):
        lines += [
            "Measured on a CPU (`--quick`: tiny models and sizes). The goals are for an H100 at SD 1.5's 512x512 "
            "and SDXL's 1024x1024; here the standing only exercises the arithmetic.",
            "",
        ]
    lines += goals(sections)
    for name, (title, data, render_section) in SECTION_RENDERERS.items():
        if name not in sections:
            continue
        section = sections[name]
        lines += ["", f"## {title}", "", _environment_line(section), ""]
        if section.get("status") == "failed":
            lines += [f"**Failed:** `{section['error']}`", ""]
        elif section.get("status") == "running":
            lines += ["*Incomplete: the run stopped before this section ended.*", ""]
        if section.get(data):
            lines += render_section(section)
    return "\n".join(lines) + "\n"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)] + [
        "| " + " | ".join(row) + " |" for row in rows
    ]


def _variants(section: dict) -> list[str]:
    return [_workload_line(section["workload"]), "", variants_table(section), *_profile_lines(section["variants"])]


def _rows_table(section: dict) -> list[str]:
    """In-process rows by variant and batch: images/s, the denoiser's it/s, latency, peak memory."""
    rows = [
        [
            row["variant"],
            str(row["batch"]),
            f"{row['images_per_s']:.2f}",
            f"{row['unet_it_s']:.1f}",
            f"{row['latency_s']:.3f}",
            f"{row['peak_memory_mib']:.0f}",
        ]
        if row["status"] == "ok"
        else [
            row["variant"],
            str(row["batch"]),
            f"{row['status']}: {(row.get('reason') or row.get('error', ''))[:120]}",
            "",
            "",
            "",
        ]
        for row in section["rows"]
    ]
    return _table(["variant", "batch", "images/s", "denoiser it/s", "seconds per call", "peak memory (MiB)"], rows)


def _scaling(section: dict) -> list[str]:
    largest = ", ".join(f"{name} {size}" for name, size in section.get("largest_batch", {}).items())
    return [
        *_rows_table(section),
        "",
        f"Largest batch that fits: {largest or 'not measured (GPU only, from the variants section)'}.",
    ]


def _sd35(section: dict) -> list[str]:
    workload = section["rows"][0]["workload"]
    name = Path(workload["model_dir"]).name
    what = " (SD 3.5 Medium's architecture, T5-XXL included, random weights)" if name == sd35.MODEL_DIR.name else ""
    return [
        f"`{name}`{what}, "
        f"{workload['width']}x{workload['height']}, {workload['steps']} {workload['scheduler']} steps, guidance "
        f"{workload['guidance_scale']}, median of {workload['repeats']} calls after a warm-up call; denoiser it/s is "
        "the transformer's, one step a forward over 2x the batch.",
        "",
        *_rows_table(section),
        "",
        f"Anchor: {SD35_LARGE_ANCHOR}.",
    ]


def _engine(section: dict) -> list[str]:
    fields = {"ratio", "engine_it_s"}
    return [
        table(
            [Row(**{key: value for key, value in row.items() if key not in fields}) for row in section["rows"]]
        ).rstrip()
    ]


def _served(section: dict) -> list[str]:
    reused = (
        " In-process ceilings an earlier run measured were taken (`--reuse-ceilings`)."
        if section.get("reuse_ceilings")
        else ""
    )
    heading = [_served_settings_text(section) + reused, ""]
    rows = [
        [
            point["mode"],
            str(point["concurrency"]),
            str(point["requests"]),
            str(point["errors"]),
            f"{point['images_per_s']:.2f}",
            number_text(point["p50_s"]),
            number_text(point["p95_s"]),
            number_text(point["ceiling_images_per_s"]),
            percent_text(point["ratio"]),
            number_text(point.get("mean_step_images")),
            percent_text(point.get("step_share")),
            percent_text(point.get("decode_share")),
        ]
        for point in section["points"]
    ]
    return (
        heading
        + _table(
            [
                "batching",
                "concurrency",
                "requests",
                "errors",
                "images/s",
                "p50 (s)",
                "p95 (s)",
                "in-process at that batch (images/s)",
                "served / in-process",
                "images per denoiser forward",
                "steps' share of the time",
                "decodes' share of the time",
            ],
            rows,
        )
        + _served_shares_note(section)
        + _served_profiles(section)
    )


def _served_settings_text(section: dict) -> str:
    """The handler settings the section's servers ran with (``--served-setting``), or "as shipped".
    Sections saved before the option name their ``decode_stream`` alone."""
    settings = section.get("settings")
    if settings is None:
        stream = section.get("decode_stream", "step")
        settings = {} if stream == "step" else {"decode_stream": stream}
    pairs = _dotted(settings)
    if not pairs:
        return "Handler settings as shipped."
    return "Handler settings: " + ", ".join(f"`{key}={value}`" for key, value in pairs) + "."


def _dotted(settings: dict, prefix: str = "") -> list[tuple[str, str]]:
    """Nested settings as ``--served-setting`` takes them: dotted keys, values as JSON."""
    pairs = []
    for key, value in settings.items():
        if isinstance(value, dict):
            pairs += _dotted(value, f"{prefix}{key}.")
        else:
            pairs.append((f"{prefix}{key}", json.dumps(value)))
    return pairs


def _served_shares_note(section: dict) -> list[str]:
    """What the steps' and decodes' shares are (points measured before they were reported have none)."""
    if not any("step_share" in point for point in section["points"]):
        return []
    return [
        "",
        "The steps' share: the server's `sd_denoise_step_seconds` summed over the point, over its wall time "
        "(on a GPU, the device's timeline from before each forward to after it, its waits for a host-bound "
        "step included). The rest is time no forward ran: admission and text encoding, decodes, answers, "
        "TorchServe's round trips. The decodes' share likewise (`sd_vae_decode_seconds`: the decode, the "
        "safety check and the conversion to images, which on a GPU run beside the next forwards: the two "
        "shares may overlap).",
    ]


def _sdxl(section: dict) -> list[str]:
    lines = [_workload_line(section["workload"]), "", variants_table(section)]
    reference = section.get("reference")
    distances = {name: d for name, d in section.get("to_reference", {}).items() if name != reference}
    if distances:
        against = "; ".join(
            f"{name}, {distance_text(distance)}{_first_step(distance)}" for name, distance in distances.items()
        )
        lines += ["", f"Against the same call in float32 (`{reference}`): {against}."]
        if any(distance.get("first_step_rel_diff") is not None for distance in distances.values()):
            lines[-1] += (
                " The images alone cannot tell float16's rounding from a graph that computes something else: "
                "with random weights, SDXL's steps amplify any difference, float32's rounding included, into "
                "a different image. The first step (the latents' change, one forward's work, relative L2 "
                "distance) can: a compiled variant's of the order of eager's (float16's rounding) "
                "is rounding; one orders of magnitude farther computes something else."
            )
    return lines


def _first_step(distance: dict) -> str:
    step = distance.get("first_step_rel_diff")
    return "" if step is None else f", first step {step:.2g}"


def _lora(section: dict) -> list[str]:
    designs = list(dict.fromkeys(row["design"] for row in section["rows"] if row["workload"] != "no LoRA"))
    by_case = {(row["workload"], row["design"]): row for row in section["rows"]}
    rows = []
    for workload in dict.fromkeys(row["workload"] for row in section["rows"]):
        cells = [by_case.get((workload, design)) or by_case[(workload, "auto")] for design in designs]
        rows.append([workload, *(f"{cell['ratio']:.2f}x ({cell['median_s'] * 1000:.1f} ms)" for cell in cells)])
    taken = [
        f"auto, {workload}: {counts.get('stacked', 0)} of {sum(counts.values())} LoRA layer forwards stacked"
        for workload, counts in section.get("auto_designs", {}).items()
    ]
    if "graphs_compiled_after_warm_up" in section:
        taken.append(
            f"compiled (LoRA slots, {section.get('compile_backend', 'inductor')}), no LoRA: "
            f"{section['compiled_plain_over_eager']:.2f}x the eager step; graphs "
            f"compiled after the warm-up round: {section['graphs_compiled_after_warm_up']}"
        )
    side = section["side"]
    heading = (
        f"8 requests, {side}x{side}, rank-{section['rank']} LoRAs; step time over no LoRA on the same denoiser "
        "(median step):"
    )
    return [heading, "", *_table(["8 requests", *designs], rows), "", *taken]


def _controlnet(section: dict) -> list[str]:
    return controlnet_table([section]).strip().splitlines()


def _cache(section: dict) -> list[str]:
    return [*cache_table(section["results"]).strip().splitlines(), "", "![step caching](gpu-cache.png)"]


# section name: (heading, the key its measurements are under, how they are rendered)
SECTION_RENDERERS = {
    "variants": ("1. SD 1.5 variants", "variants", _variants),
    "scaling": ("2. Batch scaling, in-process", "rows", _scaling),
    "engine": ("3. Step engine against the diffusers call", "rows", _engine),
    "served": ("4. Served through TorchServe (closed loop)", "points", _served),
    "sdxl": ("5. SDXL", "variants", _sdxl),
    "sd35": ("6. SD 3.5 Medium, in-process", "rows", _sd35),
    "sd35_served": ("7. SD 3.5 Medium served through TorchServe (continuous batching, closed loop)", "points", _served),
    "lora": ("8. LoRA sets in one SD 1.5 forward, per design", "rows", _lora),
    "controlnet": ("9. ControlNets in one SD 1.5 forward, against a forward per ControlNet set", "rows", _controlnet),
    "cache": ("10. Step caching per request: DeepCache on SD 1.5, first-block on SD 3.5 Medium", "results", _cache),
}


def percent_text(value: float | None) -> str:
    return "—" if value is None else f"{value:.0%}"


def _unet_bars(axis, section: dict | None, goal: float, anchors: dict[str, float], family: str) -> None:
    workload = (section or {}).get("workload")
    axis.set_title(
        f"{family}, {Path(workload['model_dir']).name} {workload['width']}x{workload['height']}, batch 1"
        if workload
        else family,
        fontsize=10,
    )
    measured = _serving(section)
    if not measured:
        axis.text(0.5, 0.5, "not measured", ha="center", va="center", transform=axis.transAxes)
        return
    axis.barh(list(measured), [row["unet_it_s"] for row in measured.values()], color="tab:blue")
    axis.invert_yaxis()
    axis.axvline(goal, color="tab:red", linestyle="--", label=f"goal {goal} it/s")
    for (label, value), style in zip(anchors.items(), (":", "-."), strict=False):
        axis.axvline(value, color="grey", linestyle=style, label=f"{label} {value}")
    axis.set_xlabel("UNet it/s")
    axis.legend(fontsize=7, loc="lower right")


def plot(sections: dict[str, dict], path: Path) -> None:
    figure, axes = plt.subplots(2, 2, figsize=(13, 9))
    variants_axis, scaling_axis, served_axis, sdxl_axis = axes.flat
    _unet_bars(variants_axis, sections.get("variants"), SD15_UNET_GOAL, SD15_ANCHORS, "SD 1.5")
    _unet_bars(sdxl_axis, sections.get("sdxl"), SDXL_UNET_GOAL, {}, "SDXL")
    scaling_axis.set_title("batch scaling, in-process", fontsize=10)
    for name in dict.fromkeys(row["variant"] for row in sections.get("scaling", {}).get("rows", [])):
        rows = [row for row in sections["scaling"]["rows"] if row["variant"] == name and row["status"] == "ok"]
        scaling_axis.plot([row["batch"] for row in rows], [row["images_per_s"] for row in rows], marker="o", label=name)
    scaling_axis.set_xlabel("batch")
    scaling_axis.set_ylabel("images/s")
    served_axis.set_title("served through TorchServe, closed loop", fontsize=10)
    served = sections.get("served", {})
    for mode in dict.fromkeys(point["mode"] for point in served.get("points", [])):
        points = [point for point in served["points"] if point["mode"] == mode]
        served_axis.plot(
            [p["concurrency"] for p in points],
            [p["images_per_s"] for p in points],
            marker="o",
            label=f"{mode} batching",
        )
    ceiling = served.get("ceiling_images_per_s", {})
    if ceiling:
        served_axis.plot(
            [int(key) for key in ceiling],
            [value or 0 for value in ceiling.values()],
            "k--",
            marker="x",
            label="in-process, batch = concurrency",
        )
    served_axis.set_xlabel("concurrency")
    served_axis.set_ylabel("images/s")
    for axis in (scaling_axis, served_axis):
        if axis.get_legend_handles_labels()[0]:
            axis.set_xscale("log", base=2)
            ticks = sorted({int(x) for line in axis.get_lines() for x in line.get_xdata()})
            axis.set_xticks(ticks, [str(tick) for tick in ticks])
            axis.legend(fontsize=8)
        else:
            axis.text(0.5, 0.5, "not measured", ha="center", va="center", transform=axis.transAxes)
    device = next((section["environment"]["device_name"] for section in sections.values()), "")
    figure.suptitle(f"make bench-gpu on {device}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def render(directory: Path) -> list[Path]:
    """Write gpu.md and gpu.png from the section files in ``directory``."""
    sections = load_sections(directory)
    paths = [directory / "gpu.md", directory / "gpu.png"]
    paths[0].write_text(markdown(sections))
    plot(sections, paths[1])
    if sections.get("cache", {}).get("results"):
        paths.append(directory / "gpu-cache.png")
        cache_plot(sections["cache"]["results"], paths[-1])
    return paths
