"""`make bench-lora`: what LoRA sets cost a batch, per design of the mixed forward, side by side.

8 one-image requests (guidance 7.5: 16 rows per forward) on the step engine, on the default model
(64x64, rank-8 LoRAs) and on SD 1.5's architecture (``bench.sd15``, random weights, 256x256,
rank-16 LoRAs), the LoRAs random on the denoiser's attention and feed-forward layers. Workloads:
no LoRA; one LoRA on all 8; 8 different LoRAs, one per request; 8 different sets drawn from 3
loaded LoRAs (alone, in pairs, all three, at other weights); 8 LyCORIS files, one per request (4
LoHa, 4 LoKr of factor 8, made by ``lycoris-lora`` on the same layers, dim 4 on the default model
and 8 at SD 1.5's size: served as exact LoRAs of rank dim^2 and up, ``handler.adapters.lycoris``;
not with the compiled denoiser, whose rank-16 slots refuse them; ``make bench-lycoris`` sets the
pairs against materialized deltas). Designs of the forward
(``handler.adapters.lora_rows``): ``grouped`` (one forward per LoRA set, as before requests with different
sets shared forwards), ``segments``, ``stacked``, ``auto`` (what the server runs), and
``compiled``: the denoiser compiled (``torch.compile``, default mode) with LoRA slots
(``handler.adapters.lora_slots``, what the server runs then), each row gathering its own slots (the
default ``loras.slot_design``), and ``compiled-stacked``: the same denoiser with every row multiplying
by every slot, both against the same compiled denoiser without LoRA, with the graphs compiled after
the warm-up round counted (the goal: none). Every
workload and design steps the same 8 jobs from the same state; the figure is the median seconds of
one step of all 8 (the sum of its forwards where grouped).
Each case is timed right after the same jobs without LoRA (paired: the ratio is the median of the
rounds' ratios, so a drift of the machine's speed cancels). Prints the ratios against no LoRA and
writes ``reports/lora/lora.{json,md,png}``.
"""

from __future__ import annotations

import copy
import logging
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from peft.tuners.lora import LoraLayer

from bench import sd15
from bench.pipeline import environment
from bench.report import plot_design_ratios, run_per_model
from handler.adapters.lora_rows import Adapters
from handler.adapters.lora_slots import compiled_graphs
from handler.config import HandlerSettings, SlotDesign
from handler.engine.jobs import DenoiseJob, JobSpec
from handler.engine.loading import load_engine, synchronize
from handler.engine.step_engine import StepEngine
from model_making.make_lora import write_lora, write_lycoris
from server.paths import DEFAULT_MODEL_DIR

logger = logging.getLogger("bench-lora")

DESIGNS = ("grouped", "segments", "stacked", "auto", "compiled", "compiled-stacked")
# design: the compiled denoiser's loras.slot_design
COMPILED: dict[str, SlotDesign] = {"compiled": "gathered", "compiled-stacked": "stacked"}
PLAIN = "no LoRA"
LYCORIS = "8 LyCORIS files"
LAYERS = ("attention", "feed_forward")
GOALS = {"default": 1.6, "sd15": 1.15}  # 8 different sets against no LoRA, the server's design


@dataclass(frozen=True)
class Model:
    name: str
    model_dir: Path | None  # None: SD 1.5's architecture, written once
    side: int
    rank: int
    spread: float  # the LoRA matrices' standard deviation
    lycoris_dim: int = 0  # the LyCORIS files' dim (LoHa, LoKr); 0: no LyCORIS workload


MODELS = {
    "default": Model("default", DEFAULT_MODEL_DIR, 64, 8, 0.3, 4),
    "sd15": Model("sd15", None, 256, 16, 0.02, 8),
}


def write_lycoris_file(model: Model, model_dir: Path, directory: Path, index: int) -> Path:
    """``lycoris{index}.safetensors`` in ``directory``: a LoHa for 0 to 3, a LoKr of factor 8 from 4,
    of the model's dim, on the denoiser's attention and feed-forward layers."""
    return write_lycoris(
        model_dir,
        directory / f"lycoris{index}.safetensors",
        "loha" if index < 4 else "lokr",
        seed=index,
        dim=model.lycoris_dim,
        alpha=model.lycoris_dim,
        spread=model.spread,
        text_encoder=False,
        only="transformer_blocks",
        **({} if index < 4 else {"factor": 8}),
    )


def workloads(ids: list[str], lycoris: list[str]) -> dict[str, list[Adapters]]:
    """The LoRA set of each of the 8 requests, per workload (``ids``: 8 loaded adapters; ``lycoris``:
    8 loaded LyCORIS files, or none)."""
    a, b, c = ids[:3]
    with_lycoris = {LYCORIS: [((adapter, 1.0),) for adapter in lycoris]} if lycoris else {}
    return {
        PLAIN: [()] * 8,
        "one LoRA, all 8": [((a, 1.0),)] * 8,
        "8 different LoRAs": [((adapter, 1.0),) for adapter in ids],
        "8 sets of 3 LoRAs": [
            ((a, 1.0),),
            ((b, 1.0),),
            ((c, 1.0),),
            ((a, 0.7), (b, 0.5)),
            ((a, 0.5), (c, 0.8)),
            ((b, 0.6), (c, 0.6)),
            ((a, 0.4), (b, 0.4), (c, 0.4)),
            ((a, 0.3),),
        ],
    } | with_lycoris


def step_seconds(engine: StepEngine, jobs: list[DenoiseJob], design: str) -> float:
    """Seconds of one step of every job: one forward, or one per LoRA set (``grouped``)."""
    groups: dict[Adapters, list[DenoiseJob]] = {}
    for job in jobs:
        groups.setdefault(job.spec.adapters if design == "grouped" else (), []).append(job)
    if design in COMPILED:
        assert engine.loras.slots is not None
        engine.loras.slots.design = COMPILED[design]
    else:
        engine.loras.row_loras.strategy = "auto" if design == "grouped" else design  # type: ignore[assignment]
    started = time.perf_counter()
    for group in groups.values():
        engine.step(group)
    synchronize(engine.device)
    return time.perf_counter() - started


def measure(model: Model, steps: int, repeats: int, compile_backend: str = "inductor") -> dict:
    """Median step seconds per workload and design on one model (``compile_backend``: the compiled
    designs' ``compile.backend``)."""
    model_dir = model.model_dir or sd15.ensure_model()
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        directory = Path(tmp)
        for index in range(8):
            write_lora(
                model_dir,
                directory / f"lora{index}.safetensors",
                seed=index,
                rank=model.rank,
                text_encoder=False,
                layers=LAYERS,
                spread=model.spread,
            )
            if model.lycoris_dim:
                write_lycoris_file(model, model_dir, directory, index)
        engines = {
            compiled: load_engine(
                HandlerSettings.model_validate(
                    {
                        "model_path": str(model_dir),
                        "loras": {"dir": str(directory), "max_loaded": 8 if compiled else 16, "slot_rank": model.rank},
                        "compile": {"enabled": compiled, "backend": compile_backend, "targets": ["unet"]},
                    }
                ),
                "/unused",
            )
            for compiled in (False, True)
        }
        ids = {
            compiled: [engine.loras.acquire([(f"lora{index}", 1.0)], set())[0][0] for index in range(8)]
            for compiled, engine in engines.items()
        }
        lycoris = [f"lycoris{index}" for index in range(8)] if model.lycoris_dim else []
        lycoris_ids = {
            False: [engines[False].loras.acquire([(name, 1.0)], set())[0][0] for name in lycoris],
            True: [],  # the compiled denoiser's rank-16 slots refuse them
        }
        lycoris_ranks = {
            kind: _rank_range(engines[False].loras.denoiser, adapters)
            for kind, adapters in (("LoHa", lycoris_ids[False][:4]), ("LoKr", lycoris_ids[False][4:]))
            if adapters
        }
    engine = engines[False]
    base = [JobSpec(f"a red circle {i}", None, (i,), model.side, model.side, steps + 1, "ddim", 7.5) for i in range(8)]
    sets_of = workloads(ids[False], lycoris_ids[False])
    cases = [
        (workload, design)
        for workload in sets_of
        if workload != PLAIN
        for design in DESIGNS
        if not (workload == LYCORIS and design in COMPILED)
    ]
    started = {
        (compiled, workload): engines[compiled].start(
            [replace(spec, adapters=adapters) for spec, adapters in zip(base, sets, strict=True)]
        )
        for compiled in engines
        for workload, sets in workloads(ids[compiled], lycoris_ids[compiled]).items()
    }

    designs = engine.loras.row_loras.designs

    def timed(workload: str, design: str) -> list[float]:
        compiled = design in COMPILED
        jobs = copy.deepcopy(started[(compiled, workload)])
        if design == "auto":
            designs.clear()
        timings = [step_seconds(engines[compiled], jobs, design) for _ in range(steps)]
        if design == "auto" and workload != PLAIN:
            taken[workload] = dict(designs)
        return timings

    taken: dict[str, dict[str, int]] = {}  # auto's designs, in layer forwards, per workload
    plain: list[float] = []
    compiled_plain: list[float] = []
    seconds: dict[tuple[str, str], list[float]] = {case: [] for case in cases}
    ratios: dict[tuple[str, str], list[float]] = {case: [] for case in cases}
    graphs = 0
    for round_ in range(repeats + 1):  # the first round warms up
        if round_ == 1:
            graphs = compiled_graphs()  # after the warm-up round
        for workload, design in cases:
            plain_design = design if design in COMPILED else "auto"  # against the same denoiser
            before, timings = timed(PLAIN, plain_design), timed(workload, design)  # paired: drift cancels
            if round_:
                (compiled_plain if design in COMPILED else plain).extend(before)
                seconds[(workload, design)].extend(timings)
                ratios[(workload, design)].append(statistics.median(timings) / statistics.median(before))
            logger.info(
                "%s round %d of %d: %s, %s: %.2fx",
                model.name,
                round_,
                repeats,
                workload,
                design,
                statistics.median(timings) / statistics.median(before),
            )
    rows = [{"workload": PLAIN, "design": "auto", "median_s": statistics.median(plain), "ratio": 1.0}] + [
        {"workload": PLAIN, "design": design, "median_s": statistics.median(compiled_plain), "ratio": 1.0}
        for design in COMPILED
    ]
    rows += [
        {
            "workload": workload,
            "design": design,
            "median_s": statistics.median(seconds[(workload, design)]),
            "ratio": statistics.median(ratios[(workload, design)]),
        }
        for workload, design in cases
    ]
    return {
        "model": model.name,
        "side": model.side,
        "rank": model.rank,
        "lycoris_dim": model.lycoris_dim,
        "lycoris_ranks": lycoris_ranks,
        "compile_backend": compile_backend,
        "environment": environment(engine.device),
        "rows": rows,
        "auto_designs": taken,
        "compiled_plain_over_eager": statistics.median(compiled_plain) / statistics.median(plain),
        "graphs_compiled_after_warm_up": compiled_graphs() - graphs,
    }


def _rank_range(denoiser, adapters: list[str]) -> tuple[int, int]:
    """The least and greatest rank of ``adapters`` over the denoiser's LoRA layers."""
    ranks = [
        layer.r[adapter]
        for layer in denoiser.modules()
        if isinstance(layer, LoraLayer)
        for adapter in adapters
        if adapter in layer.r
    ]
    return min(ranks), max(ranks)


def table(results: list[dict]) -> str:
    lines = []
    for result in results:
        lycoris = f" and dim-{result['lycoris_dim']} LyCORIS files" if result.get("lycoris_dim") else ""
        lines += [
            f"\n{result['model']} ({result['side']}x{result['side']}, rank-{result['rank']} LoRAs{lycoris} on "
            "attention and feed-forward; one step of 8 requests, 16 rows):\n",
            "| workload | " + " | ".join(DESIGNS) + " |",
            "| --- |" + " --- |" * len(DESIGNS),
        ]
        by_case = {(row["workload"], row["design"]): row for row in result["rows"]}
        for workload in dict.fromkeys(row["workload"] for row in result["rows"]):
            cells = []
            for design in DESIGNS:
                row = by_case.get((workload, design)) or by_case.get((workload, "auto"))
                if workload == LYCORIS and design in COMPILED:
                    row = None  # refused by the slots, not measured
                cells.append("refused" if row is None else f"{row['median_s'] * 1000:.1f} ms = {row['ratio']:.2f}x")
            lines.append(f"| {workload} | " + " | ".join(cells) + " |")
        goal = GOALS[result["model"]]
        auto = by_case[("8 different LoRAs", "auto")]["ratio"]
        verdict = "met" if auto <= goal else "MISSED"
        lines.append(f"\n8 different LoRAs, auto: {auto:.2f}x no LoRA (goal {goal}x): {verdict}")
        lines.append(
            f"compiled, no LoRA: {result['compiled_plain_over_eager']:.2f}x the eager step; graphs compiled after "
            f"the warm-up round (LoRAs loaded, sets changing): {result['graphs_compiled_after_warm_up']}"
        )
        if result.get("lycoris_ranks"):
            ranks = ", ".join(f"{kind} {low}..{high}" for kind, (low, high) in result["lycoris_ranks"].items())
            lines.append(f"LyCORIS files served as LoRAs of ranks {ranks} (per layer)")
        for workload, counts in result["auto_designs"].items():
            total = sum(counts.values())
            lines.append(f"auto, {workload}: {counts.get('stacked', 0)} of {total} LoRA layer forwards stacked")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> None:
    plot_design_ratios(
        results,
        DESIGNS,
        (PLAIN,),
        PLAIN,
        path,
        lambda r: f"{r['model']} {r['side']}x{r['side']}, rank {r['rank']}",
        lambda r: GOALS[r["model"]],
    )


def main() -> None:
    run_per_model(__doc__.splitlines()[0], MODELS, measure, table, plot, "lora")


if __name__ == "__main__":
    main()
