"""LoRA adapters per request: names resolved in one directory, loaded when first asked for (a file
added while the server runs is used at once, a changed file is loaded again), at most
``max_loaded`` kept in memory (least recently used evicted), never fused into the base weights.
In the denoiser, each row of a forward gets its own request's set (``handler.lora_rows``; in a
compiled denoiser, ``handler.lora_slots``: requests with different sets share the forward); the
text encoders, which run once per job, get a set with diffusers' ``set_adapters``.

A LoRA's name is its file's stem. Names are checked against ``NAME`` before any file is touched
(no separators, no ``..``, no absolute paths), and the file must resolve inside the directory (no
symlink out). Files are read with ``safetensors`` only, then handed to ``load_lora_weights`` as a
state dict, in any format it reads (diffusers/PEFT, kohya/A1111).
"""

from __future__ import annotations

import itertools
import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file

from handler.lora_rows import Adapters, RowLoras
from handler.lora_slots import SlotLoras, compiled_graphs

logger = logging.getLogger(__name__)

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
SUFFIX = ".safetensors"
__all__ = ["Adapters", "LoraBusy", "LoraError", "LoraFile", "LoraLibrary", "evict_least_recent", "valid_name"]


class LoraError(Exception):
    """A LoRA a request asks for cannot be served (HTTP 400 on ``loras``)."""

    def __init__(self, rule: str, message: str):
        self.rule = rule
        super().__init__(message)


class LoraBusy(Exception):
    """Every LoRA slot of the compiled denoiser holds an adapter of a job in flight (HTTP 503)."""


@dataclass(frozen=True)
class LoraFile:
    """One LoRA in the directory, at one version of its file."""

    name: str
    path: Path
    version: tuple[int, int]  # (modification time in ns, size): a changed file is another version

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "bytes": self.version[1], "modified_ns": self.version[0]}


def valid_name(name: str) -> bool:
    return bool(NAME.fullmatch(name)) and ".." not in name


def evict_least_recent(
    loaded: OrderedDict[Any, str], keep: set[str], enough: Callable[[], bool], forget: Callable[[str], Any], kind: str
) -> None:
    """Evict from ``loaded`` ((name, version) -> id, least recently used first) the entries whose id
    ``keep`` does not hold, ``forget`` each, until ``enough`` (the LoRA and ControlNet libraries')."""
    for key, loaded_id in list(loaded.items()):
        if enough():
            return
        if loaded_id not in keep:
            del loaded[key]
            forget(loaded_id)
            logger.info("%s %s (%s) evicted", kind, key[0], loaded_id)


class LoraLibrary:
    """The LoRAs of one directory on one pipeline (``load_lora_weights``, ``set_adapters``,
    ``disable_lora``, ``delete_adapters``) and its denoiser's row-wise path (``slots`` where the
    denoiser is compiled: at most that many adapters in its memory)."""

    def __init__(
        self,
        pipeline: Any,
        denoiser: torch.nn.Module,
        directory: Path | None,
        max_loaded: int,
        off_because: str | None = None,
        slots: SlotLoras | None = None,
    ):
        self.pipeline = pipeline
        self.denoiser = denoiser
        self.row_loras = RowLoras(denoiser)
        self.slots = slots
        self.directory = directory
        self.max_loaded = max_loaded
        self.off_because = off_because  # why LoRAs are off although a directory is set
        self._loaded: OrderedDict[tuple[str, tuple[int, int]], str] = OrderedDict()  # (name, version) -> adapter id
        self._ids = (f"lora{index}" for index in itertools.count())  # peft adapter names: module keys, no dots
        # The text encoders' set; None: unknown (a load may have activated its adapter, in the denoiser too).
        self._active: Adapters | None = ()

    @property
    def loaded(self) -> int:
        return len(self._loaded)

    def available(self) -> list[LoraFile]:
        """The LoRAs in the directory now, by name (none where it cannot be read)."""
        if self.directory is None or self.off_because is not None:
            return []
        try:
            paths = sorted(self.directory.glob(f"*{SUFFIX}"))
        except OSError:
            return []
        files = (self._file(path) for path in paths)
        return [file for file in files if file is not None]

    def _file(self, path: Path) -> LoraFile | None:
        """The LoRA at ``path`` (resolved: what is checked is what is read), or None where there is
        none: a bad name, no regular file, a symlink out of the directory, an unreadable one."""
        name = path.name[: -len(SUFFIX)]
        if not valid_name(name):
            return None
        assert self.directory is not None
        try:
            resolved = path.resolve()
            if resolved.parent != self.directory.resolve() or not resolved.is_file():
                return None
            stat = resolved.stat()
        except OSError:
            return None
        return LoraFile(name, resolved, (stat.st_mtime_ns, stat.st_size))

    def resolve(self, name: str) -> LoraFile:
        """The file of a LoRA name (checked first, so no path outside the directory is touched)."""
        if self.directory is None:
            raise LoraError(
                "loras_disabled", "this server serves no LoRAs: set handler.loras.dir (or $LORA_DIR) to a directory"
            )
        if self.off_because is not None:
            raise LoraError("loras_disabled", f"this server serves no LoRAs: {self.off_because}")
        if not valid_name(name):
            raise LoraError("lora_name", f"{name!r} is not a LoRA name (a file stem of [A-Za-z0-9_.-])")
        file = self._file(self.directory / f"{name}{SUFFIX}")
        if file is None:
            known = ", ".join(item.name for item in self.available()) or "none"
            raise LoraError("unknown_lora", f"no LoRA named {name!r} in the LoRA directory; available: {known}")
        return file

    def acquire(self, loras: Sequence[tuple[str, float]], in_use: Iterable[str]) -> Adapters:
        """The adapters for a request's ``(name, scale)`` pairs, loading the files not in memory (or
        changed since), then evicting least recently used adapters that ``in_use`` does not hold."""
        adapters: list[tuple[str, float]] = []
        try:
            for name, scale in loras:
                file = self.resolve(name)
                key = (file.name, file.version)
                if key not in self._loaded:
                    self._make_room({*in_use, *(adapter for adapter, _ in adapters)})
                    self._loaded[key] = self._load(file)
                self._loaded.move_to_end(key)
                adapters.append((self._loaded[key], scale))
        finally:
            self._evict({*in_use, *(adapter for adapter, _ in adapters)})
        return tuple(adapters)

    def _load(self, file: LoraFile) -> str:
        adapter = next(self._ids)
        self._active = None
        try:
            state_dict = load_file(file.path)
            self.pipeline.load_lora_weights(state_dict, adapter_name=adapter)
            if adapter not in self._held():  # diffusers only warns when no key matches a layer of this model
                raise ValueError("no layer of this model matches its keys (a LoRA for another model family?)")
            if self.slots is not None:
                self.slots.take(adapter)
                self._unwrap_denoiser()
            else:
                self.row_loras.attach()
                unsupported = self.row_loras.unsupported(adapter)
                if unsupported is not None:
                    raise ValueError(unsupported)
        except Exception as error:  # safetensors, format and shape errors alike: the request's 400
            self._forget(adapter)
            logger.warning("LoRA %s could not be loaded: %s", file.name, error)
            raise LoraError(
                "lora_unloadable",
                f"LoRA {file.name!r} cannot be loaded on this model: {type(error).__name__}: {str(error)[:300]}",
            ) from None
        logger.info("LoRA %s loaded as %s (%d bytes)", file.name, adapter, file.version[1])
        if self.slots is not None:  # the goal: a load compiles nothing (tests read this line)
            logger.info("LoRA slots: %d free; graphs compiled so far: %d", self.slots.free, compiled_graphs())
        return adapter

    def _make_room(self, keep: set[str]) -> None:
        """A free slot for one more adapter in a compiled denoiser: least recently used adapters that
        ``keep`` does not hold are evicted until one is free. Raises LoraBusy where every slot is kept."""
        slots = self.slots
        if slots is None:
            return
        self._evict(keep, lambda: slots.free > 0)
        if not slots.free:
            raise LoraBusy(
                f"all {slots.slots} LoRA slots of the compiled denoiser hold adapters of requests in flight "
                "(handler.loras.max_loaded); retry when they finish"
            )

    def _evict(self, keep: set[str], enough: Callable[[], bool] | None = None) -> None:
        """Evict least recently used adapters that ``keep`` does not hold until ``enough`` (by default:
        at most ``max_loaded`` in memory)."""
        enough = enough or (lambda: len(self._loaded) <= self.max_loaded)
        evict_least_recent(self._loaded, keep, enough, self._forget, "LoRA")

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
        if self.slots is not None:
            self._unwrap_denoiser()

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
    def rows(self, sets: Sequence[tuple[Adapters, int]], device: torch.device) -> Iterator[None]:
        """During the block, the denoiser's forwards give each consecutive block of rows its set:
        ``sets`` holds (set, rows) pairs in row order."""
        if self._active is None:  # after a load or a failure: every component's LoRA layers off first
            self.activate(())
        with self.row_loras.rows(sets, device) if self.slots is None else self.slots.rows(sets, device):
            yield
