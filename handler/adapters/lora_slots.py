"""LoRA sets per row in a compiled denoiser: fixed slots, so that loading an adapter recompiles nothing.

``handler.adapters.lora_rows`` reads Python objects in forward hooks (the forward's plan, PEFT's adapter
dicts), which ``torch.compile`` would guard on and recompile for. Here, before the denoiser is
compiled, every ``nn.Linear`` of its transformer blocks (attention, feed-forward, ``proj_in`` and
``proj_out``: where LoRAs go) becomes a ``SlotLinear``: the same weights, plus buffers for
``slots`` adapters of rank up to ``rank`` each, A stacked (``slots x rank``, in) and B side by side
(out, ``slots x rank``), zero where empty. A forward reads one tensor, rows x (slots x rank): each
row's weight for each slot's rank columns. So the graph only ever sees the same modules and buffers
of the same shapes, and there are two graphs per shape: with LoRA rows and without.

An adapter is loaded by diffusers (``load_lora_weights``, every format and alpha it reads), then
copied into a free slot with its scaling folded into B (``lora_alpha / r``, as ``set_adapters``
computes it), and PEFT's layers are taken out of the denoiser again (``unload_lora``), leaving the
modules it was compiled with. This is the ``stacked`` design of ``handler.adapters.lora_rows`` over every
slot: each row pays ``slots x rank`` ranks on every slot layer in a forward with LoRA rows.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from peft.tuners.lora import LoraLayer
from torch._dynamo.utils import counters

from handler.adapters.lora_rows import Adapters, base_scaling, beyond_plain_lora, weight
from handler.families.transfer import to_device

# Linear layers of transformer blocks (UNet and MMDiT alike) and the projections around them.
TARGETS = re.compile(r"(^|\.)transformer_blocks\.\d+\.|(^|\.)proj_(in|out)$")


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process (every compiled function's, recompiles included)."""
    return int(counters["stats"]["unique_graphs"])


class SlotState:
    """What every slot layer of one denoiser reads in a forward: None, or rows x (slots x rank)."""

    def __init__(self) -> None:
        self.weights: torch.Tensor | None = None


class SlotLinear(torch.nn.Linear):
    """An ``nn.Linear`` (its own weight and bias) with fixed LoRA slots: the output is
    ``base(x) + B((weights per row) * A(x))``, nothing added where the forward has no LoRA rows."""

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
            "slot_b", torch.zeros(base.out_features, slots * rank, dtype=dtype, device=device), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = F.linear(x, self.weight, self.bias)
        weights = self.state.weights
        if weights is None:
            return result
        hidden = F.linear(x, self.slot_a)
        hidden = hidden * weights.view(weights.shape[0], *[1] * (hidden.dim() - 2), weights.shape[1])
        return result + F.linear(hidden, self.slot_b)

    @torch.no_grad()
    def fill(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Slot ``slot`` holds A (rank, in) and B (out, rank), scaling folded in, zero-padded."""
        columns = slice(slot * self.rank, (slot + 1) * self.rank)
        self.clear(slot)
        self.slot_a[columns][: a.shape[0]].copy_(a)
        self.slot_b[:, columns][:, : b.shape[1]].copy_(b)

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        columns = slice(slot * self.rank, (slot + 1) * self.rank)
        self.slot_a[columns].zero_()
        self.slot_b[:, columns].zero_()


class SlotLoras:
    """The slot layers of one denoiser, which adapter holds which slot, and the forward's weights."""

    def __init__(self, denoiser: torch.nn.Module, slots: int, rank: int):
        self.denoiser = denoiser
        self.slots = slots
        self.rank = rank
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

    def weights(self, sets: Sequence[tuple[Adapters, int]], device: torch.device) -> torch.Tensor | None:
        """Rows x (slots x rank): each row's weight on the rank columns of its adapters' slots; None
        where no row holds a LoRA with a weight (the graph without LoRA)."""
        rows: list[list[float]] = []
        for adapter_set, count in sets:
            row = [0.0] * self.slots
            for adapter, scale in adapter_set:
                if adapter in self._slot_of:
                    row[self._slot_of[adapter]] += scale
            rows.extend([row] * count)
        if not any(any(row) for row in rows) and not self._lora_graph:
            return None
        dtype = next(iter(self.layers.values())).slot_a.dtype
        weights = torch.tensor(rows, dtype=torch.float64).repeat_interleave(self.rank, dim=1)
        return to_device(weights, device, dtype)

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
    def rows(self, sets: Sequence[tuple[Adapters, int]], device: torch.device) -> Iterator[torch.Tensor | None]:
        """During the block, the denoiser's forwards give each consecutive block of rows its set
        (the weights before it are back after it)."""
        outer, self.state.weights = self.state.weights, self.weights(sets, device)
        try:
            yield self.state.weights
        finally:
            self.state.weights = outer
