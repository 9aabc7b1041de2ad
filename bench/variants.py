"""The pipeline variants the benchmark compares, as changes to the handler's own settings.

Every variant is ``HandlerSettings`` plus a few overrides, so it is built by the same loading code
a worker runs (``handler.engine.loading.load_text_to_image``). Variants that do not apply to a device are
reported as skipped with the reason, never silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from handler.config import HandlerSettings

BASELINE = "vanilla-fp32"


@dataclass(frozen=True)
class Variant:
    """One way of building the pipeline."""

    name: str
    summary: str
    overrides: dict[str, Any] = field(default_factory=dict)
    cuda_only: bool = False
    env: dict[str, str] = field(default_factory=dict)  # its measuring process's environment

    @property
    def compiled(self) -> bool:
        return bool(self.overrides.get("compile", {}).get("enabled"))

    def settings(self, base: HandlerSettings) -> HandlerSettings:
        """``base`` with this variant's overrides (validated like model-config.yaml)."""
        return HandlerSettings.model_validate({**base.model_dump(), **self.overrides})

    def skip_reason(self, device: torch.device, quick: bool = False) -> str | None:
        """Why this variant cannot run on ``device`` (or is left out of a ``quick`` run); None when it can."""
        if self.cuda_only and device.type != "cuda":
            return "CUDA only"
        if quick and self.compiled and self.name != QUICK_COMPILED:
            return f"quick run: {QUICK_COMPILED} alone checks the compiled path (a cold compile takes a minute here)"
        dtype = self.overrides.get("dtype")
        if dtype == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            return f"{torch.cuda.get_device_name(device)} has no bfloat16"
        if dtype == "float16" and device.type == "mps" or self.compiled and device.type == "mps":
            return "not supported on MPS by this benchmark"
        return None


# The one compiled variant a quick run (CI) measures: the others compile the same code in another mode.
QUICK_COMPILED = "compile-default"


def _compiled(mode: str, summary: str, cuda_only: bool = False) -> Variant:
    return Variant(
        f"compile-{mode}",
        summary,
        {"compile": {"enabled": True, "mode": mode, "targets": ["unet", "vae_decoder"]}},
        cuda_only,
    )


# float32 in full: no TF32 in cuBLAS or cuDNN, whatever torch's flags, so that a float32 variant is a
# reference. handler.tf32 (on by default) turns TF32 on for matmuls and convolutions; off, it leaves
# torch's defaults, under which cuDNN's convolutions still take TF32.
FULL_FLOAT32 = {"NVIDIA_TF32_OVERRIDE": "0"}

# The baseline first: images of every other variant are compared with its images. Variants with no
# dtype override run the serving dtype (float16 on GPU, float32 on CPU; handler.engine.loading.resolve_dtype).
VARIANTS: tuple[Variant, ...] = (
    Variant(
        BASELINE,
        "AttnProcessor (softmax(QK^T)V, the full score matrix), float32 without TF32",
        {"attention": "vanilla", "dtype": "float32"},
        env=FULL_FLOAT32,
    ),
    Variant("eager", "SDPA, serving dtype: the shipped pipeline as model-config.yaml has it", {}),
    Variant("vanilla", "AttnProcessor (the full score matrix), serving dtype", {"attention": "vanilla"}),
    Variant(
        "sdpa-fp32",
        "AttnProcessor2_0 (F.scaled_dot_product_attention), float32 without TF32",
        {"dtype": "float32"},
        env=FULL_FLOAT32,
    ),
    Variant("sdpa-fp16", "SDPA, float16 weights and activations", {"dtype": "float16"}),
    Variant("sdpa-bf16", "SDPA, bfloat16 weights and activations", {"dtype": "bfloat16"}),
    Variant(
        "channels-last", "SDPA, serving dtype, UNet and VAE in channels_last memory format", {"channels_last": True}
    ),
    _compiled("default", "SDPA, serving dtype, torch.compile(mode='default') of UNet and VAE decoder"),
    _compiled(
        "reduce-overhead",
        "as compile-default with the UNet's CUDA graphs (mode='reduce-overhead'; the VAE decoder without, as a "
        "worker compiles it)",
        cuda_only=True,
    ),
    _compiled(
        "max-autotune",
        "as compile-default with kernel autotuning (mode='max-autotune'; the UNet's CUDA graphs on GPU)",
    ),
    _compiled("max-autotune-no-cudagraphs", "max-autotune without CUDA graphs", cuda_only=True),
    Variant(
        "cudagraphs",
        "SDPA, serving dtype, the UNet's eager kernels replayed as CUDA graphs (compile.backend cudagraphs: dynamo "
        "traces, inductor generates nothing; the VAE decoder eager)",
        {"compile": {"enabled": True, "backend": "cudagraphs", "targets": ["unet"]}},
        cuda_only=True,
    ),
    Variant(
        "cudagraphs-channels-last",
        "as cudagraphs with the UNet and VAE in channels_last memory format: eager's convolutions without "
        "cuDNN's layout conversions around each, in CUDA graphs (inductor picks its own layouts)",
        {"channels_last": True, "compile": {"enabled": True, "backend": "cudagraphs", "targets": ["unet"]}},
        cuda_only=True,
    ),
    Variant(
        "attention-slicing",
        "SDPA, serving dtype, attention computed in slices (pipeline.enable_attention_slicing)",
        {"attention_slicing": True},
    ),
    Variant(
        "vae-tiling",
        "SDPA, serving dtype, VAE encodes/decodes in overlapping tiles (vae.enable_tiling)",
        {"vae_tiling": True},
    ),
)
VARIANT_NAMES = tuple(variant.name for variant in VARIANTS)


def select(names: list[str] | None, baseline: str = BASELINE) -> list[Variant]:
    """The named variants in catalogue order, ``baseline`` always included; all when ``names`` is empty."""
    if not names:
        return list(VARIANTS)
    unknown = sorted(set(names) - set(VARIANT_NAMES))
    if unknown:
        raise ValueError(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANT_NAMES)}")
    return [variant for variant in VARIANTS if variant.name in {baseline, *names}]


def by_name(name: str) -> Variant:
    return VARIANTS[VARIANT_NAMES.index(name)]
