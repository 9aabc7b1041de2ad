"""Attention micro-benchmark at Stable Diffusion 1.5's largest attention shapes.

The first transformer block of SD 1.5's UNet at 512x512 attends over a 64x64 latent: 4096 tokens,
8 heads of 40 channels, batch 2 (classifier-free guidance). Self-attention is 4096 x 4096;
cross-attention attends to the 77 text tokens (width 768). Each case runs diffusers' ``Attention``
module with the two processors the pipeline can use: ``AttnProcessor`` (vanilla: the full score
matrix, then softmax) and ``AttnProcessor2_0`` (``F.scaled_dot_product_attention``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0

from bench.measure import MIB, PeakMemory
from handler.engine.loading import synchronize

PROCESSORS = {"vanilla": AttnProcessor, "sdpa": AttnProcessor2_0}


@dataclass(frozen=True)
class AttentionCase:
    name: str
    batch: int = 2
    tokens: int = 4096
    heads: int = 8
    head_dim: int = 40
    context_tokens: int | None = None  # None: self-attention
    context_dim: int = 768

    @property
    def score_matrix_mib(self) -> float:
        """Size of the float32 score matrix vanilla attention materializes (per dtype byte: x/4)."""
        keys = self.context_tokens or self.tokens
        return self.batch * self.heads * self.tokens * keys * 4 / MIB


CASES = (
    AttentionCase("self-attention 4096x4096"),
    AttentionCase("cross-attention 4096x77", context_tokens=77),
)


def _module(case: AttentionCase, device: torch.device, dtype: torch.dtype) -> Attention:
    torch.manual_seed(0)
    module = Attention(
        query_dim=case.heads * case.head_dim,
        cross_attention_dim=case.context_dim if case.context_tokens else None,
        heads=case.heads,
        dim_head=case.head_dim,
    )
    return module.to(device, dtype).eval()


def _inputs(case: AttentionCase, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    generator = torch.Generator("cpu").manual_seed(1)
    hidden = torch.randn(case.batch, case.tokens, case.heads * case.head_dim, generator=generator)
    context = None
    if case.context_tokens:
        context = torch.randn(case.batch, case.context_tokens, case.context_dim, generator=generator).to(device, dtype)
    return hidden.to(device, dtype), context


def _timed(
    module: Attention, hidden: torch.Tensor, context: torch.Tensor | None, repeats: int
) -> tuple[torch.Tensor, list[float]]:
    device = hidden.device
    times = []
    with torch.inference_mode():
        output = module(hidden, encoder_hidden_states=context)  # warm-up
        for _ in range(repeats):
            synchronize(device)
            started = time.perf_counter()
            output = module(hidden, encoder_hidden_states=context)
            synchronize(device)
            times.append(time.perf_counter() - started)
    return output, times


def run_case(case: AttentionCase, device: torch.device, dtype: torch.dtype, repeats: int) -> dict:
    """Both processors on the same module and inputs: time, peak memory, and their difference."""
    module = _module(case, device, dtype)
    hidden, context = _inputs(case, device, dtype)
    row = {
        "case": case.name,
        "dtype": str(dtype).removeprefix("torch."),
        "score_matrix_mib": case.score_matrix_mib * dtype.itemsize / 4,
    }
    outputs = {}
    for name, processor in PROCESSORS.items():
        module.set_processor(processor())
        memory = PeakMemory(device)
        memory.reset()
        outputs[name], times = _timed(module, hidden, context, repeats)
        row[name] = {
            "median_ms": statistics.median(times) * 1000,
            "peak_memory_mib": memory.peak_mib(),
            "memory_measure": memory.measure,
        }
    row["speedup"] = row["vanilla"]["median_ms"] / row["sdpa"]["median_ms"]
    row["max_abs_diff"] = (outputs["vanilla"].float() - outputs["sdpa"].float()).abs().max().item()
    return row


def run(device: torch.device, repeats: int) -> list[dict]:
    """Every case in float32, and in float16 on a GPU."""
    dtypes = [torch.float32] + ([torch.float16] if device.type == "cuda" else [])
    return [run_case(case, device, dtype, repeats) for dtype in dtypes for case in CASES]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--result", type=Path, required=True)
    args = parser.parse_args()
    args.result.write_text(json.dumps(run(torch.device(args.device), args.repeats), indent=2))


if __name__ == "__main__":
    main()
