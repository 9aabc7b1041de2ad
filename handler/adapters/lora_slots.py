"""LoRA sets per row in a compiled denoiser: fixed slots, so that loading an adapter recompiles nothing.

``handler.adapters.lora_rows`` reads Python objects in forward hooks (the forward's plan, PEFT's adapter
dicts), which ``torch.compile`` would guard on and recompile for. Here, before the denoiser is
compiled, every ``nn.Linear`` of its transformer blocks (attention, feed-forward, ``proj_in`` and
``proj_out``: where LoRAs go) becomes a ``SlotLinear``: the same weights, plus buffers for
``slots`` adapters of rank up to ``rank`` each, A stacked (``slots x rank``, in) and B transposed and
stacked (``slots x rank``, out), zero where empty. A forward reads the rows' plan (``SlotRows``),
tensors whose shapes depend on the rows (and, gathered, on the slots a row takes: the most a row
of the forward holds, marked dynamic, or a static count), so the graph only ever sees the same
modules and buffers of the same shapes, and there are two graphs per shape: with LoRA rows and
without.

Two designs (``handler.loras.slot_design``):

- ``gathered`` (punica's BGMV kernels for LLMs, in plain torch): each row gathers its own slots' A and B,
  ``k`` of them (the most any row of the forward holds, at least 2, padded with weight 0; where the
  graphs are static, ``per_row``), and multiplies its tokens by them
  (``torch.bmm``): a row pays ``k x rank`` ranks.
- ``stacked`` (the ``stacked`` design of ``handler.adapters.lora_rows`` over every slot): every row
  multiplies by every slot, weighted per row: each row pays ``slots x rank`` ranks.

An adapter is loaded by diffusers (``load_lora_weights``, every format and alpha it reads), then
copied into a free slot with its scaling folded into B (``lora_alpha / r``, as ``set_adapters``
computes it), and PEFT's layers are taken out of the denoiser again (``unload_lora``), leaving the
modules it was compiled with.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn.functional as F
from peft.tuners.lora import LoraLayer
from torch._dynamo.utils import counters

from handler.adapters.lora_rows import Adapters, base_scaling, beyond_plain_lora, weight
from handler.config import SlotDesign
from handler.families.transfer import copy_into, to_device

# Linear layers of transformer blocks (UNet and MMDiT alike) and the projections around them.
TARGETS = re.compile(r"(^|\.)transformer_blocks\.\d+\.|(^|\.)proj_(in|out)$")


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process (every compiled function's, recompiles included)."""
    return int(counters["stats"]["unique_graphs"])


class SlotRows(NamedTuple):
    """A forward's LoRA rows. ``gathered``: each row's slots (rows x k, long) and their weights
    (rows x k). ``stacked``: ``slots`` None and each row's weight on every slot's rank columns
    (rows x (slots x rank))."""

    slots: torch.Tensor | None
    weights: torch.Tensor


class SlotState:
    """What every slot layer of one denoiser reads in a forward: its rows' plan, or None (no LoRA rows)."""

    def __init__(self) -> None:
        self.rows: SlotRows | None = None


class SlotLinear(torch.nn.Linear):
    """An ``nn.Linear`` (its own weight and bias) with fixed LoRA slots: the output is
    ``base(x) + B((weights per row) * A(x))`` over each row's slots (``gathered``) or every slot
    (``stacked``), nothing added where the forward has no LoRA rows."""

    slot_a: torch.Tensor
    slot_b: torch.Tensor

    def __init__(self, base: torch.nn.Linear, state: SlotState, slots: int, rank: int):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.state = state
        self.rank = rank
        dtype, device = base.weight.dtype, base.weight.device
        self.register_buffer(
            "slot_a", torch.zeros(slots * rank, base.in_features, dtype=dtype, device=device), persistent=False
        )
        self.register_buffer(
            "slot_b", torch.zeros(slots * rank, base.out_features, dtype=dtype, device=device), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = F.linear(x, self.weight, self.bias)
        rows = self.state.rows
        if rows is None:
            return result
        if rows.slots is None:
            return result + self._stacked(x, rows.weights)
        return result + self._gathered(x, rows.slots, rows.weights)

    def _stacked(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every slot for every row, weighted per row (rows x (slots x rank))."""
        hidden = F.linear(x, self.slot_a)
        hidden = hidden * weights.view(weights.shape[0], *[1] * (hidden.dim() - 2), weights.shape[1])
        return hidden @ self.slot_b

    def _gathered(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each row's own ``k`` slots (rows x k), weighted (rows x k): one batched product per side."""
        rows = x.shape[0]
        a = self.slot_a.view(-1, self.rank, self.in_features)[slots].flatten(1, 2)  # rows, k x rank, in
        b = self.slot_b.view(-1, self.rank, self.out_features)[slots].flatten(1, 2)  # rows, k x rank, out
        hidden = torch.bmm(x.reshape(rows, -1, self.in_features), a.transpose(1, 2))
        hidden = (hidden.unflatten(2, (-1, self.rank)) * weights[:, None, :, None]).flatten(2)
        return torch.bmm(hidden, b).view(*x.shape[:-1], self.out_features)

    @torch.no_grad()
    def fill(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Slot ``slot`` holds A (rank, in) and B (out, rank), scaling folded in, zero-padded."""
        ranks = slice(slot * self.rank, (slot + 1) * self.rank)
        self.clear(slot)
        self.slot_a[ranks][: a.shape[0]].copy_(a)
        self.slot_b[ranks][: b.shape[1]].copy_(b.T)

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        ranks = slice(slot * self.rank, (slot + 1) * self.rank)
        self.slot_a[ranks].zero_()
        self.slot_b[ranks].zero_()


class SlotLoras:
    """The slot layers of one denoiser, which adapter holds which slot, and the forward's rows."""

    def __init__(
        self,
        denoiser: torch.nn.Module,
        slots: int,
        rank: int,
        design: SlotDesign = "gathered",
        per_row: int | None = None,
        replayed: bool = False,
    ):
        """``per_row`` (``gathered``): every row's slots padded to this many, a static size; None:
        to the most any row of the forward holds (at least 2), a size marked dynamic. ``replayed``:
        the denoiser replays CUDA graphs, so a forward's plan is kept in place (``rows``)."""
        self.denoiser = denoiser
        self.slots = slots
        self.rank = rank
        self.design = design
        self.per_row = per_row
        self.replayed = replayed
        self._kept: dict[tuple[tuple[int, ...] | None, tuple[int, ...]], SlotRows] = {}
        self.state = SlotState()
        self.layers: dict[str, SlotLinear] = {}
        for name, module in list(denoiser.named_modules()):
            if type(module) is torch.nn.Linear and TARGETS.search(name):
                parent, _, child = name.rpartition(".")
                layer = SlotLinear(module, self.state, slots, rank)
                setattr(denoiser.get_submodule(parent), child, layer)
                self.layers[name] = layer
        self._slot_of: dict[str, int] = {}
        self._lora_graph = False  # every forward takes the graph with LoRA rows (``lora_graph``)

    @property
    def free(self) -> int:
        return self.slots - len(self._slot_of)

    def bytes(self) -> int:
        return sum(buffer.nbytes for layer in self.layers.values() for buffer in (layer.slot_a, layer.slot_b))

    def needs_slot(self, adapter: str) -> bool:
        """Whether ``adapter`` has layers in the denoiser (one of the text encoders only has none)."""
        return any(isinstance(module, LoraLayer) and adapter in module.lora_A for module in self.denoiser.modules())

    def take(self, adapter: str) -> None:
        """Copy ``adapter`` from the denoiser's PEFT layers into a free slot. Raises ValueError (the
        slots keep what they held) where it does not fit: a LoRA on a layer without slots, a rank
        over ``rank``, a DoRA or other variant, a LoRA bias."""
        parts = []
        for name, module in self.denoiser.named_modules():
            if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
                continue
            base = module.get_base_layer()
            if not isinstance(base, SlotLinear):
                raise ValueError(
                    f"a LoRA on {name} ({type(base).__name__}) is not served with a compiled denoiser: only the "
                    "Linear layers of its transformer blocks have LoRA slots"
                )
            if module.r[adapter] > self.rank:
                raise ValueError(
                    f"rank {module.r[adapter]} on {name} is over the {self.rank} of the compiled denoiser's LoRA slots "
                    "(handler.loras.slot_rank)"
                )
            refused = beyond_plain_lora(name, module, adapter)
            if refused is not None:
                raise ValueError(refused)
            scaled_b = weight(module.lora_B[adapter]) * base_scaling(module, adapter)
            parts.append((base, weight(module.lora_A[adapter]), scaled_b))
        if not parts:
            return  # a LoRA of the text encoders only
        slot = min(set(range(self.slots)) - set(self._slot_of.values()))
        for base, a, b in parts:
            base.fill(slot, a.to(base.slot_a.dtype), b.to(base.slot_b.dtype))
        self._slot_of[adapter] = slot

    def release(self, adapter: str) -> None:
        """Empty ``adapter``'s slot (evicted or failed)."""
        slot = self._slot_of.pop(adapter, None)
        if slot is not None:
            for layer in self.layers.values():
                layer.clear(slot)

    def plan(self, sets: Sequence[tuple[Adapters, int]], device: torch.device) -> SlotRows | None:
        """Each row's weight per slot of its adapters, as the design reads it, on ``device``; None
        where no row holds a LoRA with a weight (the graph without LoRA)."""
        host = self._host_plan(sets)
        if host is None:
            return None
        plan = SlotRows(
            None if host.slots is None else to_device(host.slots, device), to_device(host.weights, device, self._dtype)
        )
        if plan.slots is not None and self.per_row is None:  # one graph for every k (a step cache's regions too)
            for tensor in plan:
                torch._dynamo.maybe_mark_dynamic(tensor, 1)
        return plan

    @property
    def _dtype(self) -> torch.dtype:
        """The slots' weights' dtype (the denoiser's)."""
        return next(iter(self.layers.values())).slot_a.dtype

    def _host_plan(self, sets: Sequence[tuple[Adapters, int]]) -> SlotRows | None:
        """``plan`` on the host, the weights in float64."""
        rows: list[dict[int, float]] = []
        for adapter_set, count in sets:
            row: dict[int, float] = {}
            for adapter, scale in adapter_set:
                if adapter in self._slot_of:
                    slot = self._slot_of[adapter]
                    row[slot] = row.get(slot, 0.0) + scale
            rows.extend([row] * count)
        if not any(any(row.values()) for row in rows) and not self._lora_graph:
            return None
        if self.design == "stacked":
            every = [[row.get(slot, 0.0) for slot in range(self.slots)] for row in rows]
            return SlotRows(None, torch.tensor(every, dtype=torch.float64).repeat_interleave(self.rank, dim=1))
        held = max((len(row) for row in rows), default=0)
        # dynamic: 2 at least (dynamo specializes a size of 1)
        k = max(2, held) if self.per_row is None else max(1, self.per_row, held)
        slots = torch.tensor([[*row, *[0] * (k - len(row))] for row in rows], dtype=torch.long)
        weights = torch.tensor([[*row.values(), *[0.0] * (k - len(row))] for row in rows], dtype=torch.float64)
        return SlotRows(slots, weights)

    @contextmanager
    def lora_graph(self) -> Iterator[None]:
        """During the block, forwards without LoRA rows take the graph with LoRA rows, at weight 0
        (the same output): warm-up compiles it before the first LoRA request."""
        self._lora_graph = True
        try:
            yield
        finally:
            self._lora_graph = False

    @contextmanager
    def rows(self, sets: Sequence[tuple[Adapters, int]], device: torch.device) -> Iterator[SlotRows | None]:
        """During the block, the denoiser's forwards give each consecutive block of rows its set
        (the plan before it is back after it: a sub-batch's is nested in its forward's)."""
        outer = self.state.rows
        self.state.rows = (
            self._kept_in_place(sets, device) if self.replayed and outer is None else self.plan(sets, device)
        )
        try:
            yield self.state.rows
        finally:
            self.state.rows = outer

    def _kept_in_place(self, sets: Sequence[tuple[Adapters, int]], device: torch.device) -> SlotRows | None:
        """``plan`` copied from the host into the tensors kept for its shape. dynamo makes the
        tensors a module reads static inputs of its graph, which a CUDA graph reads where it
        recorded them and is recorded again for where they moved: a new plan each step would
        record a graph each step."""
        host = self._host_plan(sets)
        if host is None:
            return None
        key = (None if host.slots is None else tuple(host.slots.shape), tuple(host.weights.shape))
        if key not in self._kept:
            slots = None if host.slots is None else torch.empty_like(host.slots, device=device)
            self._kept[key] = SlotRows(slots, torch.empty_like(host.weights, dtype=self._dtype, device=device))
        kept = self._kept[key]
        if kept.slots is not None and host.slots is not None:
            copy_into(kept.slots, host.slots)
        copy_into(kept.weights, host.weights)
        return kept
