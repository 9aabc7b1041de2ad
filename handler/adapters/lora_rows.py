"""LoRA sets per row of one denoiser forward: requests with different LoRA sets (or none) share
each forward, and every row gets exactly its own set's low-rank delta.

The base layers run once for the whole batch (PEFT's LoRA layers of the denoiser stay disabled, so
they return their base layer's output), and a forward hook on each LoRA layer adds the rows' deltas,
as PEFT's ``_mixed_batch_forward`` does for one adapter per row, generalised to a weighted set per
row (what ``set_adapters`` with those weights computes):

    row r:  base(x_r) + sum over the adapters a of r's set:  w_{r,a} * s_a * B_a(A_a(x_r))

with ``s_a`` the adapter's own scaling in that layer (``lora_alpha / r``, PEFT's ``set_scale`` at
weight 1, folded into B). Two ways to compute it, one class per base layer type, each with both:

- ``segments``: per adapter, its A and B on the rows whose set holds it (a view where those rows
  are one block, else gathered), added back with the rows' weights. The work is each row's own
  adapters only, in two ops per adapter.
- ``stacked``: the forward's adapters concatenated along the rank (cached per combination) and one
  pair of ops for all rows, the rank columns of adapters outside a row's set weighted 0. Two ops in
  all, but every row pays every adapter's rank.

``auto`` stacks a layer where the multiply-adds stacking adds cost less than the ops it saves
(``OP_COST``: what one op's overhead is worth on the device). On the default model (ranks large
against its 32- to 64-wide layers) that is every layer; at SD 1.5's widths it is none on a CPU and
every one on an H100. One adapter on every row is always stacked: no extra arithmetic, and its
weight per row scales A's small output rather than B's.
A forward with no LoRA in any row costs what a plain one does: the hooks return at once.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal, cast

import torch
import torch.nn.functional as F
from peft.tuners.lora import LoraLayer

from handler.families.transfer import to_device

# One LoRA set: (adapter id, weight) pairs; () for none.
Adapters = tuple[tuple[str, float], ...]
Strategy = Literal["auto", "segments", "stacked"]
# Multiply-adds one op's overhead is worth, by device type: auto stacks a layer where the extra
# multiply-adds cost less than the ops saved. CPU: between what the default model's largest layer
# needs to stack (2.4e6 per op saved) and what SD 1.5's smallest at 256x256 would (2e7), where
# `make bench-lora` measured stacked faster on the one and segments on the other. CUDA: `make
# bench-gpu` on an H100 (2026-11-26, SD 1.5 at 512x512, 16 rows, 8 rank-16 LoRAs) measured stacked
# faster on every layer, the largest needing 1.5e9 per op saved (feed-forward in, 64x64 tokens).
OP_COST = {"cpu": 1e7, "cuda": 2e9}
STACKS_PER_LAYER = 8  # adapter combinations stacked per layer (least recently used dropped)


@dataclass
class RowPlan:
    """Which adapters act on which rows of one forward, at what weight (``weights``: rows x
    adapters, 0 where a row's set lacks the adapter; an adapter at weight 0 in every row is left
    out, as its delta is 0)."""

    adapters: tuple[str, ...]
    weights: torch.Tensor
    rows: int
    uniform: dict[str, float]  # adapters every row holds at one weight: a scalar, no gather
    # The others: their rows (a slice where they are one block) and those rows' weights.
    members: dict[str, tuple[slice | torch.Tensor, torch.Tensor]]
    _rank_weights: dict[tuple, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, sets: Sequence[tuple[Adapters, int]], device: torch.device) -> RowPlan | None:
        """The plan of a forward whose consecutive row blocks hold ``(set, rows)``; None where no
        row holds a LoRA. Built from the sets' numbers on the host (no tensor value read), its
        tensors copied to the device without blocking."""
        named = tuple(dict.fromkeys(adapter for adapter_set, _ in sets for adapter, _ in adapter_set))
        rows = sum(count for _, count in sets)
        columns: dict[str, list[float]] = {adapter: [0.0] * rows for adapter in named}
        start = 0
        for adapter_set, count in sets:
            for adapter, weight in adapter_set:
                column = columns[adapter]
                for row in range(start, start + count):
                    column[row] += weight
            start += count
        adapters = tuple(adapter for adapter in named if any(columns[adapter]))  # scale 0: no delta
        if not adapters:
            return None
        uniform, members = {}, {}
        for adapter in adapters:
            values = columns[adapter]
            if all(value == values[0] for value in values):
                uniform[adapter] = values[0]
                continue
            held = [row for row, value in enumerate(values) if value]
            first, last = held[0], held[-1]
            contiguous = last - first + 1 == len(held)  # one block of jobs: a view, no gather
            rows_held = slice(first, last + 1) if contiguous else to_device(torch.tensor(held), device)
            weights_held = torch.tensor([values[row] for row in held], dtype=torch.float64)
            members[adapter] = (rows_held, to_device(weights_held, device, torch.float32))
        weights = torch.tensor([columns[adapter] for adapter in adapters], dtype=torch.float64).T
        return cls(adapters, to_device(weights.contiguous(), device, torch.float32), rows, uniform, members)

    def held(self, adapter: str) -> int:
        """How many rows hold ``adapter``."""
        return self.rows if adapter in self.uniform else len(self.members[adapter][1])

    def rank_weights(self, adapters: tuple[str, ...], ranks: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Rows x stacked rank: the rank columns of each of ``adapters`` (``ranks`` each) weighted
        as that adapter in each row."""
        key = (adapters, ranks, dtype)
        if key not in self._rank_weights:
            pairs = zip(adapters, ranks, strict=True)
            columns = [self.adapters.index(adapter) for adapter, rank in pairs for _ in range(rank)]
            index = to_device(torch.tensor(columns), self.weights.device)
            self._rank_weights[key] = self.weights.index_select(1, index).to(dtype)
        return self._rank_weights[key]


def base_scaling(layer: LoraLayer, adapter: str) -> float:
    """The adapter's scaling in ``layer`` at weight 1 (PEFT's ``set_scale``)."""
    rank = layer.r[adapter]
    return layer.lora_alpha[adapter] / (math.sqrt(rank) if layer.use_rslora.get(adapter, False) else rank)


def beyond_plain_lora(name: str, layer: LoraLayer, adapter: str) -> str | None:
    """Why ``adapter`` in ``layer`` is more than ``B(A(x))`` times its scaling (a DoRA or other
    variant, a LoRA bias), or None."""
    if adapter in getattr(layer, "lora_variant", {}):
        return f"{type(layer.lora_variant[adapter]).__name__} adapters (on {name}) are not served"
    if getattr(layer.lora_B[adapter], "bias", None) is not None:
        return f"LoRA biases (on {name}) are not served"
    return None


def weight(module: torch.nn.Module) -> torch.Tensor:
    return cast(torch.Tensor, module.weight)


@dataclass(frozen=True)
class Stack:
    """Adapters of one layer concatenated along the rank: A's weights stacked, B's side by side,
    each one's scaling folded into its B."""

    adapters: tuple[str, ...]
    ranks: tuple[int, ...]
    a: torch.Tensor
    b: torch.Tensor

    @classmethod
    def of(cls, layer: LoraLayer, adapters: tuple[str, ...]) -> Stack:
        a = torch.cat([weight(layer.lora_A[adapter]) for adapter in adapters])
        b = torch.cat([weight(layer.lora_B[adapter]) * base_scaling(layer, adapter) for adapter in adapters], dim=1)
        return cls(adapters, tuple(layer.r[adapter] for adapter in adapters), a, b)

    @classmethod
    def single(cls, layer: LoraLayer, adapter: str) -> Stack:
        """One adapter's own weights, no copy (its scaling not folded in: the caller applies it)."""
        return cls((adapter,), (layer.r[adapter],), weight(layer.lora_A[adapter]), weight(layer.lora_B[adapter]))


class LayerRows:
    """Per-row deltas for one kind of base layer: ``down`` (A), ``up`` (B) and how a weight per row
    and rank broadcasts over A's output are the subclass's."""

    def segments(
        self, layer: LoraLayer, adapters: tuple[str, ...], x: torch.Tensor, result: torch.Tensor, plan: RowPlan
    ) -> torch.Tensor:
        """PEFT's mixed-batch path with a weight per row: each adapter on the rows that hold it."""
        for adapter in adapters:
            single = Stack.single(layer, adapter)
            scaling = base_scaling(layer, adapter)
            if adapter in plan.uniform:  # as PEFT's own forward: B(A(x)) * (weight * scaling)
                result = result + self.delta(single, x, plan.uniform[adapter] * scaling).to(result.dtype)
                continue
            rows, weights = plan.members[adapter]
            delta = self.delta(single, x[rows], (weights * scaling).view(-1, 1)).to(result.dtype)
            if isinstance(rows, slice):
                result[rows] += delta  # in place: the base layer's fresh output
            else:
                result.index_add_(0, rows, delta)
        return result

    def stacked(self, stack: Stack, x: torch.Tensor, result: torch.Tensor, plan: RowPlan) -> torch.Tensor:
        """All the forward's adapters in one pair of ops, each rank column weighted per row."""
        rank_weights = plan.rank_weights(stack.adapters, stack.ranks, stack.a.dtype)
        return result + self.delta(stack, x, rank_weights).to(result.dtype)

    def delta(self, stack: Stack, x: torch.Tensor, weights: float | torch.Tensor) -> torch.Tensor:
        """B(weights * A(x)): ``weights`` a scalar, or rows x (1 or the stacked rank)."""
        hidden = self.down(stack, x.to(stack.a.dtype))
        if isinstance(weights, torch.Tensor):
            return self.up(stack, hidden * self.broadcast(weights.to(hidden.dtype), hidden))
        return self.up(stack, hidden) * weights

    def down(self, stack: Stack, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def up(self, stack: Stack, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def broadcast(self, weights: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def fan(self) -> int:
        """Multiply-adds per output position and unit of rank: A's inputs plus B's outputs."""
        raise NotImplementedError

    def outputs(self) -> int:
        raise NotImplementedError


class LinearRows(LayerRows):
    """``nn.Linear`` base layers: A is (rank, in), B is (out, rank); the rank is the last dim."""

    def __init__(self, base: torch.nn.Linear):
        self.base = base

    def fan(self) -> int:
        return self.base.in_features + self.base.out_features

    def outputs(self) -> int:
        return self.base.out_features

    def down(self, stack: Stack, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, stack.a)

    def up(self, stack: Stack, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, stack.b)

    def broadcast(self, weights: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        rows, rank = weights.shape
        return weights.view(rows, *[1] * (hidden.dim() - 2), rank)


class Conv2dRows(LayerRows):
    """``nn.Conv2d`` base layers: A is a conv of the base's kernel, stride and padding to ``rank``
    channels (PEFT builds it so), B a 1x1 conv back; the rank is the channel dim."""

    def __init__(self, layer: LoraLayer):
        self.layer = layer
        self.base = cast(torch.nn.Conv2d, layer.get_base_layer())

    def down(self, stack: Stack, x: torch.Tensor) -> torch.Tensor:
        conv = cast(torch.nn.Conv2d, self.layer.lora_A[stack.adapters[0]])
        return F.conv2d(x, stack.a, None, conv.stride, conv.padding, conv.dilation, conv.groups)

    def up(self, stack: Stack, hidden: torch.Tensor) -> torch.Tensor:
        return F.conv2d(hidden, stack.b)

    def broadcast(self, weights: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        rows, rank = weights.shape
        return weights.view(rows, rank, *[1] * (hidden.dim() - 2))

    def fan(self) -> int:
        return self.base.in_channels * math.prod(self.base.kernel_size) + self.base.out_channels

    def outputs(self) -> int:
        return self.base.out_channels


def rows_for(layer: LoraLayer) -> LayerRows | None:
    """The per-row path of a LoRA layer's base layer, or None where there is none."""
    base = layer.get_base_layer()
    if type(base) is torch.nn.Linear:
        return LinearRows(base)
    # PEFT groups the B of a grouped conv, and leaves A undilated (its output size then differs).
    if type(base) is torch.nn.Conv2d and base.groups == 1 and base.dilation == (1, 1):
        return Conv2dRows(layer)
    return None


class RowLoras:
    """The row-wise LoRA path of one denoiser: hooks on its LoRA layers, the current forward's
    plan, and the stacks built for it (bounded per layer, dropped with any of their adapters)."""

    def __init__(self, denoiser: torch.nn.Module, strategy: Strategy = "auto"):
        self.denoiser = denoiser
        self.strategy = strategy
        self._plan: RowPlan | None = None
        self._layers: dict[int, LoraLayer] = {}  # by id
        self._stacks: dict[int, OrderedDict[tuple[str, ...], Stack]] = {}
        self.designs: Counter[str] = Counter()  # layer forwards per design taken (make bench-lora reports it)

    def switch_off(self) -> None:
        """PEFT's own path off in every hooked layer (it returns its base layer's output)."""
        for layer in self._layers.values():
            layer.enable_adapters(False)

    def attach(self) -> None:
        """Hook the LoRA layers a load added (PEFT wraps a base layer when an adapter first targets it)."""
        for module in self.denoiser.modules():
            if isinstance(module, LoraLayer) and id(module) not in self._layers:
                kind = rows_for(module)
                if kind is None:
                    continue  # refused at load (``unsupported``)
                module.register_forward_hook(self._hook_for(kind))
                self._layers[id(module)] = module

    def unsupported(self, adapter: str) -> str | None:
        """Why ``adapter`` cannot go through the row path (a DoRA or other variant, a LoRA on a layer
        type without per-row deltas, a LoRA bias), or None."""
        for name, module in self.denoiser.named_modules():
            if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
                continue
            if rows_for(module) is None:
                return f"a LoRA on {name} ({module.get_base_layer()}) is not served"
            refused = beyond_plain_lora(name, module, adapter)
            if refused is not None:
                return refused
        return None

    def forget(self, adapter: str) -> None:
        """Drop the stacks that hold ``adapter`` (evicted or unloaded)."""
        for stacks in self._stacks.values():
            for key in [key for key in stacks if adapter in key]:
                del stacks[key]

    @contextmanager
    def rows(self, sets: Sequence[tuple[Adapters, int]], device: torch.device) -> Iterator[RowPlan | None]:
        """During the block, the denoiser's forwards give each consecutive block of ``rows`` rows
        its LoRA ``set`` (nested: a sub-batch of the forward; the forward's plan is back after it)."""
        outer, self._plan = self._plan, RowPlan.of(sets, device)
        try:
            yield self._plan
        finally:
            self._plan = outer

    def _hook_for(self, kind: LayerRows):
        def hook(layer: LoraLayer, args: tuple, result: torch.Tensor) -> torch.Tensor | None:
            plan = self._plan
            if plan is None:
                return None
            x = args[0]
            if x.shape[0] != plan.rows:
                raise RuntimeError(f"a LoRA layer got {x.shape[0]} rows in a forward of {plan.rows}")
            present = tuple(adapter for adapter in plan.adapters if adapter in layer.lora_A)
            if not present:
                return None
            if self._use_stacked(kind, layer, plan, present, result):
                self.designs["stacked"] += 1
                return kind.stacked(self._stack(layer, present), x, result, plan)
            self.designs["segments"] += 1
            return kind.segments(layer, present, x, result, plan)

        return hook

    def _use_stacked(
        self, kind: LayerRows, layer: LoraLayer, plan: RowPlan, present: tuple[str, ...], result: torch.Tensor
    ) -> bool:
        """``auto``: stack where the multiply-adds every row pays for the adapters it does not hold
        cost less than the ops of one segment per adapter."""
        if self.strategy != "auto":
            return self.strategy == "stacked"
        positions = result.numel() // (plan.rows * kind.outputs())  # tokens or output pixels per row
        unused = sum((plan.rows - plan.held(adapter)) * layer.r[adapter] for adapter in present)
        extra = unused * positions * kind.fan()
        return extra <= OP_COST.get(result.device.type, OP_COST["cuda"]) * 2 * (len(present) - 1)

    def _stack(self, layer: LoraLayer, adapters: tuple[str, ...]) -> Stack:
        """The stack of ``adapters`` in ``layer``, built once per combination (kept while used)."""
        stacks = self._stacks.setdefault(id(layer), OrderedDict())
        if adapters not in stacks:
            stacks[adapters] = Stack.of(layer, adapters)
            while len(stacks) > STACKS_PER_LAYER:
                stacks.popitem(last=False)
        stacks.move_to_end(adapters)
        return stacks[adapters]
