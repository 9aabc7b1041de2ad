"""LoRA adapters per request, served from a directory of ``.safetensors`` files by name
(``handler.adapters.library``: a file added while the server runs is used at once, a changed file
is loaded again, at most ``max_loaded`` in memory), never fused into the base weights. In the
denoiser, each row of a forward gets its own request's set (``handler.adapters.lora_rows``; in a
compiled denoiser, ``handler.adapters.lora_slots``: requests with different sets share the
forward); the text encoders, which run once per job, get a set with diffusers' ``set_adapters``.

A LoRA's name is its file's stem. Files are read with ``safetensors`` only, then handed to
``load_lora_weights`` as a state dict, in any format it reads (diffusers/PEFT, kohya/A1111); a
LyCORIS LoHa or LoKr file as the exact LoRA of its deltas (``handler.adapters.lycoris``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file

from handler.adapters.library import Busy, Entry, Kind, Library
from handler.adapters.lora_rows import Adapters, RowLoras
from handler.adapters.lora_slots import SlotLoras, SlotRows, compiled_graphs
from handler.adapters.lycoris import as_lora, holds_lycoris

logger = logging.getLogger(__name__)

LORAS = Kind("LoRA", "loras", "handler.loras.dir (or $LORA_DIR)", "a file stem", suffix=".safetensors")


class LoraLibrary(Library):
    """The LoRAs of one directory on one pipeline (``load_lora_weights``, ``set_adapters``,
    ``disable_lora``, ``delete_adapters``) and its denoiser's row-wise path (``slots`` where the
    denoiser is compiled: at most that many adapters of the denoiser in its memory)."""

    kind = LORAS

    def __init__(
        self,
        pipeline: Any,
        denoiser: torch.nn.Module,
        directory: Path | None,
        max_loaded: int,
        off_because: str | None = None,
        slots: SlotLoras | None = None,
    ):
        super().__init__(directory, max_loaded, off_because)
        self.pipeline = pipeline
        self.denoiser = denoiser
        self.row_loras = RowLoras(denoiser)
        self.slots = slots
        # The text encoders' set; None: unknown (a load may have activated its adapter, in the denoiser too).
        self._active: Adapters | None = ()

    def acquire(self, loras: Sequence[tuple[str, float]], in_use: Iterable[str]) -> Adapters:
        """The adapters for a request's ``(name, scale)`` pairs, loading the files not in memory (or
        changed since), then evicting least recently used adapters that ``in_use`` does not hold."""
        adapters = self._acquire([name for name, _ in loras], in_use)
        return tuple(zip(adapters, (scale for _, scale in loras), strict=True))

    def _load(self, entry: Entry, keep: set[str]) -> str:
        adapter = next(self._ids)
        self._active = None
        try:
            state_dict = load_file(entry.path)
            if holds_lycoris(state_dict):
                state_dict = as_lora(self.pipeline, state_dict)
            self.pipeline.load_lora_weights(state_dict, adapter_name=adapter)
            if adapter not in self._held():  # diffusers only warns when no key matches a layer of this model
                raise ValueError("no layer of this model matches its keys (a LoRA for another model family?)")
            if self.slots is not None:
                self._take_slot(adapter, keep)
            else:
                self.row_loras.attach()
                unsupported = self.row_loras.unsupported(adapter)
                if unsupported is not None:
                    raise ValueError(unsupported)
        except Busy:
            self._discard(adapter)
            raise
        except Exception as error:  # safetensors, format, shape and memory errors alike
            self._discard(adapter)
            raise self.unloadable(entry, error) from None
        logger.info("LoRA %s loaded as %s (%d bytes)", entry.name, adapter, entry.version[1])
        if self.slots is not None:  # the goal: a load compiles nothing (tests read this line)
            logger.info("LoRA slots: %d free; graphs compiled so far: %d", self.slots.free, compiled_graphs())
        return adapter

    def _take_slot(self, adapter: str, keep: set[str]) -> None:
        """A compiled denoiser's slot for a loaded adapter that has denoiser layers (one of the text
        encoders only takes none): least recently used adapters that ``keep`` does not hold are
        evicted until one is free. Raises Busy where every slot is kept."""
        slots = self.slots
        assert slots is not None
        if slots.needs_slot(adapter) and not slots.free:
            self._evict(keep, lambda: slots.free > 0)
            if not slots.free:
                raise Busy(
                    f"all {slots.slots} LoRA slots of the compiled denoiser hold adapters of requests in flight "
                    "(handler.loras.max_loaded); retry when they finish"
                )
        slots.take(adapter)
        self._unwrap_denoiser()

    def _held(self) -> set[str]:
        """The adapters some component of the pipeline holds."""
        return {name for names in self.pipeline.get_list_adapters().values() for name in names}

    def _forget(self, adapter: str) -> None:
        """Remove an adapter from every component that holds it (also a half-loaded one)."""
        self._active = None
        self.row_loras.forget(adapter)
        if self.slots is not None:
            self.slots.release(adapter)
        if adapter in self._held():
            self.pipeline.delete_adapters(adapter)

    def _discard(self, adapter: str) -> None:
        """A half-loaded adapter out of every component, and a compiled denoiser's own modules back
        first: deleting its last adapter drops the denoiser's ``peft_config`` but leaves PEFT's
        layers in place, which would recompile the denoiser at its next forward."""
        if self.slots is not None:
            self._unwrap_denoiser()
        self._forget(adapter)

    def _unwrap_denoiser(self) -> None:
        """PEFT's layers out of a compiled denoiser (its adapters live in slots): the modules it was
        compiled with are back, so nothing recompiles."""
        if hasattr(self.denoiser, "peft_config"):
            cast(Any, self.denoiser).unload_lora()

    def activate(self, adapters: Adapters) -> None:
        """Make exactly ``adapters`` (ids and scales) act in the text encoders: ``set_adapters``, or
        ``disable_lora`` for none; the denoiser's LoRA layers stay off (``rows`` serves them).
        Nothing to do when they already are."""
        if adapters == self._active:
            return
        if not self._loaded:
            self._active = ()
            return
        self._active = None  # unknown until the calls below succeed
        held = self._held()  # a compiled denoiser's adapters live in slots: only text encoders' here
        acting = [(adapter, scale) for adapter, scale in adapters if adapter in held]
        if acting:
            self.pipeline.enable_lora()
            self.pipeline.set_adapters([adapter for adapter, _ in acting], [scale for _, scale in acting])
            self.row_loras.switch_off()
        else:
            self.pipeline.disable_lora()
        self._active = adapters

    @contextmanager
    def rows(self, sets: Sequence[tuple[Adapters, int]], device: torch.device) -> Iterator[SlotRows | None]:
        """During the block, the denoiser's forwards give each consecutive block of rows its set:
        ``sets`` holds (set, rows) pairs in row order (nested: a sub-batch of the forward). Yields
        the compiled denoiser's slot rows (None: no LoRA rows, or an eager denoiser)."""
        if self._active is None:  # after a load or a failure: every component's LoRA layers off first
            self.activate(())
        if self.slots is None:
            with self.row_loras.rows(sets, device):
                yield None
        else:
            with self.slots.rows(sets, device) as slot_rows:
                yield slot_rows
