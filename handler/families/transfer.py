"""Copies between host and device that do not block: a tensor built on the host during a step (a
per-row plan) goes to a CUDA device from pinned memory, and decoded pixels come back into pinned
memory, queued on the stream, so the host never waits for the device (a copy from or to pageable
memory synchronizes the stream)."""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A CPU ``tensor`` on ``device`` (in ``dtype``, converted on the host), copied without blocking."""
    tensor = tensor if dtype is None else tensor.to(dtype)
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A device ``tensor``'s copy in host memory: on CUDA queued on the stream without blocking,
    into pinned memory of the same strides (read it once the stream has passed the copy); from
    another device copied now; a host tensor as it is."""
    if tensor.device.type == "cpu":
        return tensor
    if tensor.device.type != "cuda":
        return tensor.cpu()
    host = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)
