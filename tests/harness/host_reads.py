"""Counting the operations of a block of code that read a tensor's value on the host: on a GPU
each of them waits for the device."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

READS = {torch.ops.aten._local_scalar_dense, torch.ops.aten.is_nonzero, torch.ops.aten.nonzero, torch.ops.aten.item}


class HostReads(TorchDispatchMode):
    """The value-reading operations dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in READS:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


class ValueReads(TorchFunctionMode):
    """Tensor methods that take values to the host (a dispatch mode does not see a CPU tensor's
    ``tolist``; on a GPU it is a synchronization), and ``torch.linalg.solve``, which reads its
    result's status there (under inference mode its check is not dispatched; ``solve_ex`` has none)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in {"tolist", "item", "__bool__", "__float__", "__int__", "__index__", "linalg_solve"}:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))
