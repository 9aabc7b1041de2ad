"""Stable Diffusion families on the step engine, one module each behind one contract
(``handler.families.base.Family``): SD 1.x/2.x (``sd``), SDXL (``sdxl``), SD 3.x (``sd3``).

A new family is a ``Family`` subclass in a module of its own, listed in ``FAMILIES``. The family is
detected from the loaded pipeline's exact class (a subclass may change the arithmetic); any other
pipeline is refused at load, naming the supported ones.
"""

from __future__ import annotations

import torch

from handler.config import SchedulerName
from handler.families.base import (
    Conditioning,
    Decoded,
    Family,
    Pipeline,
    Residuals,
    Scheduler,
    SchedulerChoice,
    TextEmbedding,
    UnsupportedPipeline,
)
from handler.families.sd import SCHEDULERS as SD_SCHEDULERS
from handler.families.sd import StableDiffusionFamily
from handler.families.sd3 import SCHEDULERS as SD3_SCHEDULERS
from handler.families.sd3 import StableDiffusion3Family
from handler.families.sdxl import StableDiffusionXLFamily

__all__ = [
    "FAMILIES",
    "SCHEDULERS",
    "SUPPORTED",
    "Scheduler",
    "Conditioning",
    "Decoded",
    "Family",
    "Pipeline",
    "Residuals",
    "StableDiffusion3Family",
    "StableDiffusionFamily",
    "StableDiffusionXLFamily",
    "TextEmbedding",
    "UnsupportedPipeline",
    "family_of",
]

FAMILIES: tuple[type[Family], ...] = (StableDiffusionFamily, StableDiffusionXLFamily, StableDiffusion3Family)
SUPPORTED = (
    "StableDiffusionPipeline (SD 1.x, SD 2.x), StableDiffusionXLPipeline (SDXL), "
    "StableDiffusion3Pipeline (SD 3, SD 3.5)"
)
# Every family's schedulers by name (the names are unique across families).
SCHEDULERS: dict[SchedulerName, SchedulerChoice] = {**SD_SCHEDULERS, **SD3_SCHEDULERS}


def family_of(pipeline: Pipeline, device: torch.device, dtype: torch.dtype, max_sequence_length: int = 256) -> Family:
    """The family of a loaded pipeline, by its exact class. Raises ``UnsupportedPipeline`` naming
    the class and the supported ones (or why this one of a supported class is not)."""
    family = next((family for family in FAMILIES if type(pipeline) is family.pipeline_class), None)
    if family is None:
        raise UnsupportedPipeline(
            f"{type(pipeline).__name__} is not supported by this handler's step engine; supported: {SUPPORTED}"
        )
    refusal = family.refuse(pipeline)
    if refusal is not None:
        raise UnsupportedPipeline(refusal)
    return family(pipeline, device, dtype, max_sequence_length)
