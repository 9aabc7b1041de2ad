"""ControlNets per request, served from a directory of diffusers ControlNet directories by name
(``handler.adapters.library``: a directory added while the server runs is used at once, a changed
one is loaded again, at most ``max_loaded`` in memory, those of jobs in flight kept).

A ControlNet is a diffusers directory (``config.json`` and safetensors weights; the family's
``controlnet_class``) named by its directory name, or, for a UNet family, a single ``.safetensors``
file (A1111's ``models/ControlNet``, LDM or diffusers keys;
``handler.checkpoints.single_file.load_controlnet_file``) named by its stem. Every file read must
resolve inside the ControlNet directory (no symlink out), and weights are read from safetensors
only. A ControlNet must fit the served denoiser (the family says: ``Family.controlnet_refusal``).

In a denoising step (``residuals``), each ControlNet runs ONCE over the rows of the jobs that use
it in their start/end window, each row with its own control input and scale; its residuals are
added into zero tensors for all rows of the denoiser forward, so rows without a ControlNet get zeros
(exact: ``x + 0 == x``) and a row with several gets their sum, as diffusers' ``MultiControlNetModel``
and ``SD3MultiControlNetModel``. Each place the denoiser adds a residual takes one of each
ControlNet's (``Family.control_slots``: an SD 3.x ControlNet of fewer blocks than the transformer
spreads each over several), so ControlNets of different depths share a forward.
With a compiled UNet (``every_forward``), a forward no row of which uses a ControlNet takes zero
residuals too: one graph serves forwards with and without ControlNets, so warm-up compiles it and no
request compiles it while serving.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL.Image import Image

from handler.adapters.library import Entry, Kind, Library
from handler.checkpoints.single_file import load_controlnet_file
from handler.families import Conditioning, Family, Residuals
from handler.families.transfer import to_device

logger = logging.getLogger(__name__)

WEIGHTS_SUFFIX = ".safetensors"
CONTROLNETS = Kind(
    "ControlNet",
    "controlnets",
    "handler.controlnets.dir (or $CONTROLNET_DIR)",
    "a directory name or a file stem",
    suffix=WEIGHTS_SUFFIX,
    marker="config.json",
)


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
    """A job's ControlNet with what it reads of its control image (``Family.control_input``) and
    which of its residuals each place of the denoiser's forward adds (``Family.control_slots``)."""

    spec: ControlSpec
    image: torch.Tensor  # one for all the job's rows (a UNet family's pixels), or one per row (SD 3.x's latents)
    slots: tuple[int, ...]


class ControlNetLibrary(Library):
    """The ControlNets of one directory for one family's denoiser, on one device and dtype."""

    kind = CONTROLNETS

    def __init__(
        self,
        family: Family,
        directory: Path | None,
        max_loaded: int,
        device: torch.device,
        dtype: torch.dtype,
        every_forward: bool = False,
    ):
        off_because = None if family.rules.controlnets else f"{family.rules.family} models take no ControlNets"
        super().__init__(directory, max_loaded, off_because)
        self.family = family
        self.device = device
        self.dtype = dtype
        # Residuals in every forward (zeros where no row uses a ControlNet), where ControlNets are served
        # and passed to the denoiser's forward.
        self.every_forward = (
            every_forward and directory is not None and off_because is None and not family.controls_in_blocks
        )
        self._nets: dict[str, torch.nn.Module] = {}  # id -> the loaded ControlNetModel

    def acquire(self, names: Sequence[str], in_use: Iterable[str]) -> list[str]:
        """The ids of the loaded ControlNets for a request's names, loading those not in memory (or
        changed since) after making room, then evicting least recently used ones ``in_use`` does not hold."""
        return self._acquire(names, in_use)

    def run(
        self,
        net_id: str,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        conditioning: Conditioning,
        images: torch.Tensor,
    ) -> Residuals:
        """One loaded ControlNet over rows (scale 1)."""
        return self.family.control_forward(self._nets[net_id], latents, timesteps, conditioning, images)

    def net(self, net_id: str) -> torch.nn.Module:
        """A loaded ControlNet (``Family.control_input`` reads its config)."""
        return self._nets[net_id]

    def available(self) -> list[Entry]:
        """The entries a request may name: single files only where the family builds them."""
        entries = super().available()
        return entries if self.family.controlnet_files else [entry for entry in entries if not entry.path.is_file()]

    def _load(self, entry: Entry, keep: set[str]) -> str:
        try:
            if entry.path.is_file():
                if not self.family.controlnet_files:
                    raise ValueError(
                        f"single-file {self.family.name} ControlNets are not served (diffusers converts none): "
                        "a diffusers directory (config.json and safetensors weights) is"
                    )
                net = load_controlnet_file(entry.path, self.family.denoiser, self.dtype)
            else:
                net = self._from_directory(entry.path)
            refusal = self.family.controlnet_refusal(net.config)
            if refusal is not None:
                raise ValueError(refusal)
            net = self.family.prepare_controlnet(net.to(self.device).eval().requires_grad_(False))
        except Exception as error:  # config, format, shape and memory errors alike
            raise self.unloadable(entry, error) from None
        net_id = next(self._ids)
        self._nets[net_id] = net
        logger.info("ControlNet %s loaded as %s (%d bytes)", entry.name, net_id, entry.version[1])
        return net_id

    def _from_directory(self, directory: Path) -> torch.nn.Module:
        weights = [path for path in directory.iterdir() if path.name.endswith(WEIGHTS_SUFFIX)]
        if not weights:
            raise ValueError(f"no {WEIGHTS_SUFFIX} weights (only safetensors are read)")
        config = directory / self.kind.marker
        outside = [path.name for path in [config, *weights] if path.resolve().parent != directory]
        if outside:
            raise ValueError(f"{', '.join(outside)} resolve outside its directory")
        declared, taken = json.loads(config.read_text()).get("_class_name"), self.family.controlnet_class.__name__
        if declared not in (None, taken):
            raise ValueError(
                f"its {config.name} declares class {declared}; this {self.family.name} model takes class {taken}"
            )
        return self.family.controlnet_class.from_pretrained(
            str(directory), torch_dtype=self.dtype, use_safetensors=True, local_files_only=True
        )

    def _forget(self, loaded_id: str) -> None:
        del self._nets[loaded_id]

    def residuals(
        self,
        uses: Sequence[tuple[Sequence[Control], int]],
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        conditioning: Conditioning,
    ) -> tuple[Residuals | None, int]:
        """The residuals for one denoiser forward whose consecutive blocks of rows are jobs: ``uses``
        holds each job's acting ControlNets and its rows, in row order. Each ControlNet runs once over
        the rows that use it. Each place of the forward adds, on each job's rows, the residual its
        ``Control.slots`` say of each of its ControlNets, scaled, summed in ControlNet order into
        zeros (a tensor per distinct combination of residuals). Returns the residuals (where no row
        uses a ControlNet: None, or zeros with ``every_forward``) and the ControlNet forwards run."""
        rows_of: dict[str, list[tuple[torch.Tensor, Control]]] = {}
        offset = 0
        for controls, rows in uses:
            index = torch.arange(offset, offset + rows, device=latents.device)
            for control in controls:
                rows_of.setdefault(control.spec.net, []).append((index, control))
            offset += rows
        if not rows_of:
            return (self.family.control_zeros(latents, self.dtype) if self.every_forward else None), 0
        parts = [control for net_parts in rows_of.values() for _, control in net_parts]  # in the order run
        keys = [tuple(control.slots[place] for control in parts) for place in range(len(parts[0].slots))]
        distinct = list(dict.fromkeys(keys))  # each a sum of the ControlNets' residuals some places add
        totals: dict[tuple[int, ...], torch.Tensor] = {}  # per distinct key, made once
        position = 0
        for net_id, net_parts in rows_of.items():
            index = torch.cat([part for part, _ in net_parts])
            inputs = torch.cat(
                [control.image.expand(len(part), *control.image.shape[1:]) for part, control in net_parts]
            )
            scales = [control.spec.scale for part, control in net_parts for _ in range(len(part))]
            row_scales = to_device(torch.tensor(scales), latents.device)
            samples = self.run(net_id, latents[index], timesteps[index], conditioning.rows(index), inputs)
            start = 0
            for part, _ in net_parts:
                span = slice(start, start + len(part))
                for key in distinct:
                    sample = samples[key[position]][span]
                    if key not in totals:
                        totals[key] = _zero_rows(sample, offset)
                    scaled = sample * row_scales[span].view(-1, *[1] * (sample.dim() - 1))
                    totals[key].index_add_(0, part, scaled.to(totals[key].dtype))
                start, position = span.stop, position + 1
        return [totals[key] for key in keys], len(rows_of)


def _zero_rows(like: torch.Tensor, rows: int) -> torch.Tensor:
    """Zeros for ``rows`` rows of a residual like ``like``."""
    return torch.zeros((rows, *like.shape[1:]), dtype=like.dtype, device=like.device)
