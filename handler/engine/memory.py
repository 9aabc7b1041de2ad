"""Device memory after running out of it: what a retry does first."""

from __future__ import annotations

import torch


def release_cached_memory() -> None:
    """Hand cached blocks back to the device after running out of memory, before a retry."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
