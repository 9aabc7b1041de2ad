"""Model files read safely: a safetensors header is read, and checked against the file's size,
before any tensor is; pickle files are refused by name."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

PICKLE_SUFFIXES = frozenset({".ckpt", ".pt", ".pth", ".bin", ".pkl", ".pickle"})


class CheckpointError(ValueError):
    """A model file that cannot be served; the message names the file and why."""


@dataclass(frozen=True)
class Header:
    """What a safetensors file holds, read from its header only: each tensor's shape and dtype."""

    path: Path
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]

    def has(self, prefix: str) -> bool:
        """Whether any tensor's name starts with ``prefix``."""
        return any(name.startswith(prefix) for name in self.shapes)

    def dtypes_under(self, prefix: str) -> str:
        """The dtypes of the tensors under ``prefix``, most frequent first (``F16``, ``F32:3``...)."""
        counts: dict[str, int] = {}
        for name, dtype in self.dtypes.items():
            if name.startswith(prefix):
                counts[dtype] = counts.get(dtype, 0) + 1
        ranked = sorted(counts.items(), key=lambda item: -item[1])
        return ",".join(dtype if count == max(counts.values()) else f"{dtype}:{count}" for dtype, count in ranked)

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor, read alone."""
        with safe_open(self.path, "pt") as file:
            return file.get_tensor(name)


def read_tensors(path: Path, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The tensors of a checked file whose names start with one of ``prefixes``, the others left unread."""
    try:
        with safe_open(path, "pt") as file:
            return {name: file.get_tensor(name) for name in file.keys() if name.startswith(prefixes)}
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{path.name}: its tensors cannot be read ({error})") from error


def refuse_pickle(path: Path) -> None:
    """Refuse a pickle file by name: loading one runs code it carries."""
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise CheckpointError(
            f"{path.name}: a pickle file ({path.suffix}); only .safetensors files are served (loading a pickle runs "
            "the code it carries): convert it to safetensors first"
        )


def read_header(path: Path) -> Header:
    """The header of the safetensors file at ``path``; ``safetensors`` checks that its offsets cover
    the file exactly, so a truncated file or one claiming absurd sizes is refused before anything is
    allocated."""
    refuse_pickle(path)
    if path.suffix.lower() != ".safetensors":
        raise CheckpointError(f"{path.name}: not a .safetensors file")
    try:
        with safe_open(path, "pt") as file:
            names = list(file.keys())
            slices = {name: file.get_slice(name) for name in names}
            return Header(
                path,
                {name: tuple(piece.get_shape()) for name, piece in slices.items()},
                {name: piece.get_dtype() for name, piece in slices.items()},
            )
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{path.name}: not a readable safetensors file ({error})") from error
