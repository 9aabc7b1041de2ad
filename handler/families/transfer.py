"""Copies between host and device that do not block: a tensor built on the host during a step (a
per-row plan) or while jobs start (token ids, CPU noise, input images) goes to a CUDA device from
pinned memory, and decoded pixels come back into pinned memory, queued on the stream, so the host
never waits for the device (a copy from or to pageable memory synchronizes the stream)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def to_device(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``tensor`` on ``device`` in ``dtype``: a CPU tensor to a CUDA device converted on the host
    into a pinned copy (dense, whatever the source's strides), queued without blocking; anything
    else as ``Tensor.to`` makes it (to another device copied now: a copy that does not block from
    pageable memory may read it after it is freed)."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device=device, dtype=dtype)
    return copy_into(torch.empty_like(tensor, dtype=dtype, device=device), tensor)


def copy_into(target: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values copied into ``target`` (of its shape, converted to its dtype): from a
    host tensor into a CUDA one through a pinned copy, queued without blocking; otherwise as
    ``Tensor.copy_`` copies."""
    if target.device.type != "cuda" or tensor.device.type != "cpu":
        return target.copy_(tensor)
    pinned = torch.empty_like(tensor, dtype=target.dtype, pin_memory=True).copy_(tensor)
    # copy_ rather than Tensor.to: under QueuedCopies a ``to`` would be staged again
    return target.copy_(pinned, non_blocking=True)


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


class QueuedCopies(TorchFunctionMode):
    """While active, a host tensor's ``Tensor.to`` a device of ``device``'s type is ``to_device``'s
    copy. On CUDA it is queued without blocking, so code that is not ours (diffusers'
    ``encode_prompt`` copying the token ids, ``randn_tensor`` its CPU noise, ``add_noise`` DDIM's
    table, the image processors their pixels) waits for nothing queued before it. Left as asked:
    a ``memory_format``, ``copy`` given by position, tensor subclasses, and copies made other ways
    (``torch.tensor(..., device=)``, ``Tensor.cuda``, indexing a device tensor with a list)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device_type = device.type

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.to and type(args[0]) is torch.Tensor and args[0].device.type == "cpu":
            target = {name: value for name, value in kwargs.items() if name != "copy"}  # a copy either way
            try:
                device, dtype, _, memory_format = torch._C._nn._parse_to(*args[1:], **target)
            except (RuntimeError, TypeError):  # a form this does not read (``copy`` given by position): as asked
                return func(*args, **kwargs)
            if device is not None and device.type == self.device_type and memory_format is None:
                return to_device(args[0], device, dtype)
        return func(*args, **kwargs)


def queued_copies(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``QueuedCopies`` to a CUDA ``device``; nothing elsewhere (no copy that could be queued)."""
    return QueuedCopies(device) if device.type == "cuda" else contextlib.nullcontext()
