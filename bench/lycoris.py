"""`make bench-lycoris`: LyCORIS deltas as the exact LoRA pairs served against materialized deltas, per layer.

``make bench-lora``'s 8 LyCORIS files (4 LoHa, 4 LoKr of factor 8, made by ``lycoris-lora`` on the
denoiser's attention and feed-forward layers) on the default model (dim 4, 64x64) and SD 1.5's
architecture (``bench.sd15``, random weights, dim 8, 256x256). One step of 8 one-image requests
(guidance 7.5: 16 rows), one file each, records every adapter layer's input; then, per layer and
adapter on its own 2 rows, ``x A^T B^T`` (the pair ``handler.adapters.lycoris`` serves) and
``x (B A)^T`` (a materialized delta: what a merged-weight path or PEFT's LoHa and LoKr layers
multiply by, building the delta not counted) alternate, ``--steps`` passes over every layer a
round, for ``--repeats`` rounds after a warm-up one. Prints the median seconds per layer width and
in all, with the ratio deltas / pairs, and writes ``reports/lycoris/lycoris.{json,md,png}``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from peft.tuners.lora import LoraLayer

from bench import sd15
from bench.loras import MODELS, Model, write_lycoris_file
from bench.pipeline import environment
from bench.report import run_per_model
from handler.config import HandlerSettings
from handler.engine.jobs import JobSpec
from handler.engine.loading import load_engine, synchronize
from handler.engine.step_engine import StepEngine

FILES = 8


def measure(model: Model, steps: int, repeats: int) -> dict:
    """Median seconds of every recorded layer input's delta, as pairs and as materialized deltas,
    per layer width (``in x out``) and in all."""
    model_dir = model.model_dir or sd15.ensure_model()
    with tempfile.TemporaryDirectory(prefix="bench-lycoris-") as tmp:
        directory = Path(tmp)
        for index in range(FILES):
            write_lycoris_file(model, model_dir, directory, index)
        settings = {"model_path": str(model_dir), "loras": {"dir": str(directory), "max_loaded": FILES}}
        engine = load_engine(HandlerSettings.model_validate(settings), "/unused")
        adapters = [engine.loras.acquire([(f"lycoris{index}", 1.0)], set())[0][0] for index in range(FILES)]
    work = recorded_work(engine, model, adapters)
    seconds: dict[str, dict[str, list[float]]] = defaultdict(lambda: {"pairs": [], "deltas": []})
    with torch.no_grad():
        for round_ in range(repeats + 1):  # the first round warms up
            for width, items in work.items():
                pairs = timed(
                    engine, steps, [lambda x=x, a=a, b=b: F.linear(F.linear(x, a), b) for x, a, b, _ in items]
                )
                deltas = timed(engine, steps, [lambda x=x, delta=delta: F.linear(x, delta) for x, _, _, delta in items])
                if round_:
                    seconds[width]["pairs"].append(pairs)
                    seconds[width]["deltas"].append(deltas)
    rows = [
        {
            "width": width,
            "inputs": len(work[width]),
            "ranks": sorted({a.shape[0] for _, a, _, _ in work[width]}),
            "pairs_s": statistics.median(times["pairs"]),
            "deltas_s": statistics.median(times["deltas"]),
        }
        for width, times in seconds.items()
    ]
    return {
        "model": model.name,
        "side": model.side,
        "dim": model.lycoris_dim,
        "environment": environment(engine.device),
        "rows": rows,
        "pairs_s": sum(row["pairs_s"] for row in rows),
        "deltas_s": sum(row["deltas_s"] for row in rows),
    }


def recorded_work(engine: StepEngine, model: Model, adapters: list[str]) -> dict[str, list[tuple]]:
    """Per layer width, (input rows, A, B, B A) of every adapter on its own rows, the inputs as one
    step of 8 requests (one adapter each) gave them to the denoiser's Linear LoRA layers."""
    layers = {
        name: layer
        for name, layer in engine.loras.denoiser.named_modules()
        if isinstance(layer, LoraLayer) and isinstance(layer.get_base_layer(), torch.nn.Linear)
    }
    inputs: dict[str, torch.Tensor] = {}

    def record(name: str):
        def hook(_layer, args, _output) -> None:  # returning None keeps the layer's output
            inputs.setdefault(name, args[0].detach())

        return hook

    hooks = [layer.register_forward_hook(record(name)) for name, layer in layers.items()]
    specs = [
        JobSpec(f"a red circle {i}", None, (i,), model.side, model.side, 2, "ddim", 7.5, adapters=((adapter, 1.0),))
        for i, adapter in enumerate(adapters)
    ]
    try:
        engine.step(engine.start(specs))
    finally:
        for hook in hooks:
            hook.remove()
    work: dict[str, list[tuple]] = defaultdict(list)
    for name, x in inputs.items():
        layer = layers[name]
        base = layer.get_base_layer()
        rows = x.shape[0] // len(adapters)
        for index, adapter in enumerate(adapters):
            if adapter in layer.lora_A:
                a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
                part = x[index * rows : (index + 1) * rows].contiguous()
                work[f"{base.in_features}x{base.out_features}"].append((part, a, b, b @ a))
    return dict(sorted(work.items(), key=lambda item: int(item[0].split("x")[0])))


def timed(engine: StepEngine, passes: int, calls: list) -> float:
    """Seconds of ``passes`` passes over ``calls``."""
    started = time.perf_counter()
    for _ in range(passes):
        for call in calls:
            call()
    synchronize(engine.device)
    return time.perf_counter() - started


def table(results: list[dict]) -> str:
    lines = []
    for result in results:
        lines += [
            f"\n{result['model']} ({result['side']}x{result['side']}, dim-{result['dim']} LoHa and LoKr files; "
            "each adapter's delta on its own 2 rows of one step's layer inputs):\n",
            "| layer (in x out) | inputs | pair ranks | exact LoRA pairs | materialized deltas | deltas / pairs |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for row in result["rows"]:
            ranks = f"{row['ranks'][0]}..{row['ranks'][-1]}"
            lines.append(
                f"| {row['width']} | {row['inputs']} | {ranks} | {row['pairs_s'] * 1000:.1f} ms | "
                f"{row['deltas_s'] * 1000:.1f} ms | {row['deltas_s'] / row['pairs_s']:.2f}x |"
            )
        lines.append(
            f"| all | | | {result['pairs_s'] * 1000:.1f} ms | {result['deltas_s'] * 1000:.1f} ms | "
            f"**{result['deltas_s'] / result['pairs_s']:.2f}x** |"
        )
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> None:
    figure, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for axis, result in zip(axes[0], results, strict=True):
        names = [row["width"] for row in result["rows"]] + ["all"]
        ratios = [row["deltas_s"] / row["pairs_s"] for row in result["rows"]]
        ratios.append(result["deltas_s"] / result["pairs_s"])
        axis.bar(names, ratios)
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_ylabel("materialized deltas / exact LoRA pairs (time)")
        axis.set_xlabel("layer (in x out)")
        axis.set_title(f"{result['model']} {result['side']}x{result['side']}, dim {result['dim']}")
        axis.tick_params(axis="x", labelsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    run_per_model(__doc__.splitlines()[0], MODELS, measure, table, plot, "lycoris")


if __name__ == "__main__":
    main()
