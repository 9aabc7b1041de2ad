"""ControlNets per request: names resolved in one directory, loaded when first asked for (a
directory added while the server runs is used at once, a changed one is loaded again), at most
``max_loaded`` kept in memory (least recently used evicted, those of jobs in flight kept).

A ControlNet is a diffusers directory (``config.json`` and safetensors weights) named by its
directory name. Names are checked against ``handler.loras.NAME`` before any file is touched (no
separators, no ``..``, no absolute paths), the directory and every file read must resolve inside
the ControlNet directory (no symlink out), and weights are read from safetensors only. A ControlNet
must fit the served UNet (the family says: ``Family.controlnet_refusal``).

In a denoising step (``residuals``), each ControlNet runs ONCE over the rows of the jobs that use
it in their start/end window, each row with its own control image and scale; its residuals are
added into zero tensors for all rows of the UNet forward, so rows without a ControlNet get zeros
(exact: ``x + 0 == x``) and a row with several gets their sum, as diffusers' ``MultiControlNetModel``.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import ControlNetModel
from PIL.Image import Image

from handler.families import Conditioning, Family, Residuals
from handler.loras import evict_least_recent, valid_name

logger = logging.getLogger(__name__)

CONFIG = "config.json"
WEIGHTS_SUFFIX = ".safetensors"


class ControlNetError(Exception):
    """A ControlNet a request asks for cannot be served (HTTP 400 on ``controlnets``)."""

    def __init__(self, rule: str, message: str):
        self.rule = rule
        super().__init__(message)


@dataclass(frozen=True)
class ControlNetDir:
    """One ControlNet in the directory, at one version of its files."""

    name: str
    path: Path
    version: tuple[int, int]  # (newest modification time in ns, total size): a changed file is another version

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "bytes": self.version[1], "modified_ns": self.version[0]}


@dataclass(frozen=True)
class ControlSpec:
    """One ControlNet of a job: the loaded net's id, its control image, its scale
    (``controlnet_conditioning_scale``) and its window (``control_guidance_start`` and ``_end``,
    shares of the job's steps)."""

    net: str
    image: Image
    scale: float = 1.0
    start: float = 0.0
    end: float = 1.0

    def acts(self, step: int, steps: int) -> bool:
        """Whether it acts in step ``step`` of ``steps``: the pipelines' ``controlnet_keep`` is 1."""
        return not (step / steps < self.start or (step + 1) / steps > self.end)


@dataclass(frozen=True)
class Control:
    """A job's ControlNet with its control image as the pipelines' ``prepare_image`` makes it."""

    spec: ControlSpec
    image: torch.Tensor  # (1, 3, height, width) in [0, 1]


class ControlNetLibrary:
    """The ControlNets of one directory for one family's UNet, on one device and dtype."""

    def __init__(
        self,
        family: Family,
        directory: Path | None,
        max_loaded: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        self.family = family
        self.directory = directory
        self.max_loaded = max_loaded
        self.device = device
        self.dtype = dtype
        self._loaded: OrderedDict[tuple[str, tuple[int, int]], str] = OrderedDict()  # (name, version) -> id
        self._nets: dict[str, torch.nn.Module] = {}  # id -> the loaded ControlNetModel
        self._ids = (f"controlnet{index}" for index in itertools.count())

    @property
    def loaded(self) -> int:
        return len(self._loaded)

    def available(self) -> list[ControlNetDir]:
        """The ControlNets in the directory now, by name (none where it cannot be read)."""
        if self.directory is None or not self.family.rules.controlnets:
            return []
        try:
            paths = sorted(path for path in self.directory.iterdir() if path.is_dir())
        except OSError:
            return []
        found = (self._dir(path) for path in paths)
        return [item for item in found if item is not None]

    def _dir(self, path: Path) -> ControlNetDir | None:
        """The ControlNet at ``path`` (resolved: what is checked is what is read), or None where there
        is none: a bad name, no directory with a config, a symlink out of the ControlNet directory."""
        if not valid_name(path.name):
            return None
        assert self.directory is not None
        try:
            resolved = path.resolve()
            if resolved.parent != self.directory.resolve() or not (resolved / CONFIG).is_file():
                return None
            stats = [item.stat() for item in resolved.iterdir() if item.is_file()]
        except OSError:
            return None
        return ControlNetDir(
            path.name, resolved, (max(stat.st_mtime_ns for stat in stats), sum(stat.st_size for stat in stats))
        )

    def resolve(self, name: str) -> ControlNetDir:
        """The directory of a ControlNet name (checked first, so no path outside the directory is touched)."""
        if self.directory is None:
            raise ControlNetError(
                "controlnets_disabled",
                "this server serves no ControlNets: set handler.controlnets.dir (or $CONTROLNET_DIR) to a directory",
            )
        if not valid_name(name):
            message = f"{name!r} is not a ControlNet name (a directory name of [A-Za-z0-9_.-])"
            raise ControlNetError("controlnet_name", message)
        found = self._dir(self.directory / name)
        if found is None:
            known = ", ".join(item.name for item in self.available()) or "none"
            raise ControlNetError(
                "unknown_controlnet", f"no ControlNet named {name!r} in the ControlNet directory; available: {known}"
            )
        return found

    def acquire(self, names: Sequence[str], in_use: Iterable[str]) -> list[str]:
        """The ids of the loaded ControlNets for a request's names, loading those not in memory (or
        changed since), then evicting least recently used ones that ``in_use`` does not hold."""
        ids: list[str] = []
        try:
            for name in names:
                found = self.resolve(name)
                key = (found.name, found.version)
                if key not in self._loaded:
                    self._loaded[key] = self._load(found)
                self._loaded.move_to_end(key)
                ids.append(self._loaded[key])
        finally:
            self._evict({*in_use, *ids})
        return ids

    def _load(self, found: ControlNetDir) -> str:
        weights = [path for path in found.path.iterdir() if path.name.endswith(WEIGHTS_SUFFIX)]
        try:
            if not weights:
                raise ValueError(f"no {WEIGHTS_SUFFIX} weights (only safetensors are read)")
            outside = [path.name for path in [found.path / CONFIG, *weights] if path.resolve().parent != found.path]
            if outside:
                raise ValueError(f"{', '.join(outside)} resolve outside its directory")
            net = ControlNetModel.from_pretrained(
                str(found.path), torch_dtype=self.dtype, use_safetensors=True, local_files_only=True
            )
            refusal = self.family.controlnet_refusal(net.config)
            if refusal is not None:
                raise ValueError(refusal)
            net = net.to(self.device).eval().requires_grad_(False)
        except Exception as error:  # config, format, shape and memory errors alike: the request's 400
            logger.warning("ControlNet %s could not be loaded: %s", found.name, error)
            raise ControlNetError(
                "controlnet_unloadable",
                f"ControlNet {found.name!r} cannot be loaded on this model: {type(error).__name__}: {str(error)[:300]}",
            ) from None
        net_id = next(self._ids)
        self._nets[net_id] = net
        logger.info("ControlNet %s loaded as %s (%d bytes)", found.name, net_id, found.version[1])
        return net_id

    def _evict(self, keep: set[str]) -> None:
        """Evict least recently used ControlNets that ``keep`` does not hold until at most
        ``max_loaded`` are in memory."""
        evict_least_recent(
            self._loaded, keep, lambda: len(self._loaded) <= self.max_loaded, self._nets.pop, "ControlNet"
        )

    def residuals(
        self,
        uses: Sequence[tuple[Sequence[Control], int]],
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        conditioning: Conditioning,
    ) -> tuple[Residuals | None, int]:
        """The residuals for one UNet forward whose consecutive blocks of rows are jobs: ``uses``
        holds each job's acting ControlNets and its rows, in row order. Each ControlNet runs once over
        the rows that use it. Returns the residuals (None: no row uses a ControlNet) and the ControlNet
        forwards run."""
        rows_of: dict[str, list[tuple[torch.Tensor, Control]]] = {}
        offset = 0
        for controls, rows in uses:
            index = torch.arange(offset, offset + rows, device=latents.device)
            for control in controls:
                rows_of.setdefault(control.spec.net, []).append((index, control))
            offset += rows
        if not rows_of:
            return None, 0
        down: list[torch.Tensor] = []
        mid = torch.empty(0)
        for net_id, parts in rows_of.items():
            index = torch.cat([part for part, _ in parts])
            images = torch.cat([control.image.expand(len(part), -1, -1, -1) for part, control in parts])
            scales = torch.cat([torch.full((len(part),), control.spec.scale) for part, control in parts])
            net_down, net_mid = self.family.control_forward(
                self._nets[net_id], latents[index], timesteps[index], _rows(conditioning, index), images
            )
            scales = scales.to(latents.device).view(-1, 1, 1, 1)
            if not down:
                down = [_zero_rows(sample, offset) for sample in net_down]
                mid = _zero_rows(net_mid, offset)
            for total, sample in zip(down, net_down, strict=True):
                total.index_add_(0, index, (sample * scales).to(total.dtype))
            mid.index_add_(0, index, (net_mid * scales).to(mid.dtype))
        return (down, mid), len(rows_of)


def _zero_rows(like: torch.Tensor, rows: int) -> torch.Tensor:
    """Zeros for ``rows`` rows of a residual like ``like``."""
    return torch.zeros((rows, *like.shape[1:]), dtype=like.dtype, device=like.device)


def _rows(conditioning: Conditioning, index: torch.Tensor) -> Conditioning:
    """The conditioning of some rows of a forward."""
    return Conditioning(
        conditioning.hidden_states[index], {name: value[index] for name, value in conditioning.added.items()}
    )
