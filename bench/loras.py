"""`make bench-lora`: what a LoRA costs a request, measured side by side in one process.

The same 8 one-image requests (default model, 64x64, 20 DDIM steps) run on the step engine as the
service runs a batch, in alternation: all without LoRA; all with the shipped outline LoRA (one
forward per step, the adapter active); half with the outline LoRA and half with another (two
forwards per step: the grouped batch); each with its own scale (eight sets: eight forwards per
step). Then the switch itself: ``set_adapters`` between two sets and back, alone. Prints medians and
ratios against the plain batch and writes ``reports/lora/lora.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from bench.jobs import generate
from bench.pipeline import environment
from handler.config import HandlerSettings
from handler.engine import JobSpec
from handler.pipeline import load_engine
from model_making.make_lora import write_lora
from server.paths import DEFAULT_MODEL_DIR, REPORTS, ROOT

logger = logging.getLogger("bench-lora")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--output", type=Path, default=REPORTS / "lora" / "lora.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        directory = Path(tmp)
        shutil.copy(ROOT / "loras" / "outline.safetensors", directory / "outline.safetensors")
        write_lora(DEFAULT_MODEL_DIR, directory / "other.safetensors", seed=1)
        settings = HandlerSettings.model_validate(
            {"model_path": str(DEFAULT_MODEL_DIR), "loras": {"dir": str(directory), "max_loaded": 8}}
        )
        engine = load_engine(settings, "/unused")
        outline, other = (engine.loras.acquire([(name, 1.0)], set())[0][0] for name in ("outline", "other"))
        base = [JobSpec(f"a red circle {i}", None, (i,), 64, 64, args.steps, "ddim", 7.5) for i in range(8)]
        batches = {
            "no LoRA": base,
            "one LoRA, all 8": [replace(spec, adapters=((outline, 1.0),)) for spec in base],
            "two LoRA sets of 4": [
                replace(spec, adapters=((outline if i < 4 else other, 1.0),)) for i, spec in enumerate(base)
            ],
            "eight LoRA sets (own scales)": [
                replace(spec, adapters=((outline, 0.5 + i / 8),)) for i, spec in enumerate(base)
            ],
        }
        timings: dict[str, list[float]] = {name: [] for name in batches}
        for _ in range(args.repeats + 1):  # the first round warms up
            for name, specs in batches.items():
                started = time.perf_counter()
                generate(engine, specs)
                timings[name].append(time.perf_counter() - started)
        sets = [((outline, 1.0),), ((other, 0.7),)]
        switches = []
        for index in range(200):
            started = time.perf_counter()
            engine.loras.activate(sets[index % 2])
            switches.append(time.perf_counter() - started)
    medians = {name: statistics.median(values[1:]) for name, values in timings.items()}
    plain = medians["no LoRA"]
    for name, seconds in medians.items():
        print(f"{name}: median {seconds:.3f} s for 8 images = {seconds / plain:.2f}x no LoRA")
    switch = statistics.median(switches)
    print(f"switching LoRA sets (set_adapters): median {switch * 1000:.2f} ms")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    report = {"environment": environment(engine.device), "steps": args.steps, "medians_s": medians, "switch_s": switch}
    args.output.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
