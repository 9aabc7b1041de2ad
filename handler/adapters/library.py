"""Directories of named entries that requests name: a LoRA file, a ControlNet directory, and the
next such kinds. One ``Library`` finds an entry by name, lists and versions the entries, loads one
on first use (a changed entry is loaded again) and keeps at most ``max_loaded`` in memory, least
recently used evicted first (never one a job in flight holds), making room before it loads.

Names are checked against ``NAME`` before any file is touched (no separators, no ``..``, no
absolute paths), and an entry must resolve inside its directory (no symlink out).
"""

from __future__ import annotations

import itertools
import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def valid_name(name: str) -> bool:
    """Whether ``name`` can name an entry: a file or directory name of [A-Za-z0-9_.-], no ``..``."""
    return bool(NAME.fullmatch(name)) and ".." not in name


class EntryError(Exception):
    """An entry a request names cannot be served: HTTP 400 on the request field, with ``rule``."""

    def __init__(self, rule: str, message: str):
        self.rule = rule
        super().__init__(message)


class Busy(Exception):
    """What loading an entry needs is held now (device memory, a compiled denoiser's LoRA slots):
    HTTP 503 with ``Retry-After``, not the request's fault."""


@dataclass(frozen=True)
class Entry:
    """One entry of a directory at one version of its files."""

    name: str
    path: Path  # resolved: what was checked is what is read
    version: tuple[int, int]  # (newest modification time in ns, total size): a changed file is another version

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "bytes": self.version[1], "modified_ns": self.version[0]}


@dataclass(frozen=True)
class Kind:
    """What the entries of one library are and how requests and operators name them: files of a
    suffix, directories holding a marker file, or both (a name then is either; a directory first)."""

    what: str  # "LoRA": in messages
    field: str  # the request field naming them, "loras": rule names derive from it
    setting: str  # where the directory is set: "handler.loras.dir (or $LORA_DIR)"
    naming: str  # what a name is: "a file stem"
    suffix: str = ""  # file entries: the file's suffix; "" for none
    marker: str = ""  # directory entries: the file every entry holds; "" for none

    @property
    def rule(self) -> str:
        """The singular of the field, as rule names use it: ``lora``."""
        return self.field.removesuffix("s")

    def name_of(self, path: Path) -> str | None:
        """The name of an entry at ``path`` if it is one (``version`` checks its files)."""
        if self.marker and path.is_dir():
            return path.name
        if self.suffix and path.name.endswith(self.suffix):
            return path.name[: -len(self.suffix)]
        return None

    def paths_of(self, directory: Path, name: str) -> list[Path]:
        """Where an entry of ``name`` may be: its directory, then its file."""
        paths = []
        if self.marker:
            paths.append(directory / name)
        if self.suffix:
            paths.append(directory / f"{name}{self.suffix}")
        return paths

    def candidates(self, directory: Path) -> list[Path]:
        return sorted(path for path in directory.iterdir() if self.name_of(path) is not None)

    def version(self, resolved: Path) -> tuple[int, int] | None:
        """The version of an entry's files, or None where ``resolved`` is no entry of this kind."""
        if self.suffix and resolved.is_file():
            stat = resolved.stat()
            return stat.st_mtime_ns, stat.st_size
        if not self.marker or not (resolved / self.marker).is_file():
            return None
        stats = [item.stat() for item in resolved.iterdir() if item.is_file()]
        return max(stat.st_mtime_ns for stat in stats), sum(stat.st_size for stat in stats)


class Library:
    """The entries of one directory and those loaded in memory, by (name, version), least recently
    used first. Subclasses load (``_load``, returning the loaded entry's id) and forget (``_forget``)."""

    kind: Kind

    def __init__(self, directory: Path | None, max_loaded: int, off_because: str | None = None):
        self.directory = directory
        self.max_loaded = max_loaded
        self.off_because = off_because  # why none are served although a directory is set
        self._loaded: OrderedDict[tuple[str, tuple[int, int]], str] = OrderedDict()  # (name, version) -> id
        self._ids = (f"{self.kind.rule}{index}" for index in itertools.count())  # no dots: PEFT module keys

    @property
    def loaded(self) -> int:
        return len(self._loaded)

    def available(self) -> list[Entry]:
        """The entries in the directory now, by name, each name once as ``resolve`` takes it (a
        directory sorts before its name's file; none where the directory cannot be read)."""
        if self.directory is None or self.off_because is not None:
            return []
        try:
            paths = self.kind.candidates(self.directory)
        except OSError:
            return []
        found: dict[str, Entry] = {}
        for entry in map(self._entry, paths):
            if entry is not None:
                found.setdefault(entry.name, entry)
        return list(found.values())

    def _entry(self, path: Path) -> Entry | None:
        """The entry at ``path``, or None where there is none: a bad name, no file or directory of
        this kind, a symlink out of the directory, an unreadable one."""
        name = self.kind.name_of(path)
        if name is None or not valid_name(name):
            return None
        assert self.directory is not None
        try:
            resolved = path.resolve()
            if resolved.parent != self.directory.resolve():
                return None
            version = self.kind.version(resolved)
        except OSError:
            return None
        return None if version is None else Entry(name, resolved, version)

    def resolve(self, name: str) -> Entry:
        """The entry of a name (checked first, so no path outside the directory is touched)."""
        kind = self.kind
        if self.directory is None:
            raise EntryError(
                f"{kind.field}_disabled", f"this server serves no {kind.what}s: set {kind.setting} to a directory"
            )
        if self.off_because is not None:
            raise EntryError(f"{kind.field}_disabled", f"this server serves no {kind.what}s: {self.off_because}")
        if not valid_name(name):
            raise EntryError(
                f"{kind.rule}_name", f"{name!r} is not a {kind.what} name ({kind.naming} of [A-Za-z0-9_.-])"
            )
        found = (self._entry(path) for path in kind.paths_of(self.directory, name))
        entry = next((entry for entry in found if entry is not None and entry.name == name), None)
        if entry is None:
            known = ", ".join(item.name for item in self.available()) or "none"
            raise EntryError(
                f"unknown_{kind.rule}",
                f"no {kind.what} named {name!r} in the {kind.what} directory; available: {known}",
            )
        return entry

    def _acquire(self, names: Sequence[str], in_use: Iterable[str]) -> list[str]:
        """The ids of the loaded entries for ``names``, loading those not in memory (or changed
        since) after making room, then evicting least recently used ones ``in_use`` does not hold."""
        ids: list[str] = []
        try:
            for name in names:
                entry = self.resolve(name)
                key = (entry.name, entry.version)
                if key not in self._loaded:
                    keep = {*in_use, *ids}
                    self._evict(keep, lambda: len(self._loaded) < self.max_loaded)  # room first
                    self._loaded[key] = self._load(entry, keep)
                self._loaded.move_to_end(key)
                ids.append(self._loaded[key])
        finally:
            self._evict({*in_use, *ids})
        return ids

    def _load(self, entry: Entry, keep: set[str]) -> str:
        """Load ``entry`` and return its id; ``keep``: the ids a job in flight or starting holds.
        Raises ``EntryError`` where it cannot be served, ``Busy`` where memory is short now."""
        raise NotImplementedError

    def _forget(self, loaded_id: str) -> None:
        raise NotImplementedError

    def _evict(self, keep: set[str], enough: Callable[[], bool] | None = None) -> None:
        """Evict least recently used entries that ``keep`` does not hold until ``enough`` (by
        default: at most ``max_loaded`` in memory)."""
        enough = enough or (lambda: len(self._loaded) <= self.max_loaded)
        for key, loaded_id in list(self._loaded.items()):
            if enough():
                return
            if loaded_id not in keep:
                del self._loaded[key]
                self._forget(loaded_id)
                logger.info("%s %s (%s) evicted", self.kind.what, key[0], loaded_id)

    def unloadable(self, entry: Entry, error: Exception) -> Exception:
        """What a failed load raises: ``Busy`` when the device ran out of memory (the server's
        condition), else the request's ``EntryError`` naming the entry and the error."""
        if isinstance(error, torch.OutOfMemoryError):
            logger.warning("%s %s could not be loaded: out of device memory", self.kind.what, entry.name)
            return Busy(f"{self.kind.what} {entry.name!r} does not fit in device memory now; retry later")
        logger.warning("%s %s could not be loaded: %s", self.kind.what, entry.name, error)
        return EntryError(
            f"{self.kind.rule}_unloadable",
            f"{self.kind.what} {entry.name!r} cannot be loaded on this model: {type(error).__name__}: "
            f"{str(error)[:300]}",
        )
