"""Host-to-device copies that do not block: a tensor built on the host during a step (a per-row
plan) goes to a CUDA device from pinned memory, queued on the stream, so the host never waits for
the device (a copy from pageable memory synchronizes the stream)."""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A CPU ``tensor`` on ``device`` (in ``dtype``, converted on the host), copied without blocking."""
    tensor = tensor if dtype is None else tensor.to(dtype)
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
