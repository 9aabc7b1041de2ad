"""What a job's rows cost in one denoiser forward, in plain rows of its latent shape: the unit of the
step-time profile's cap and of the memory limits it learns (``handler.engine.scheduling``).

A plain row costs 1. Each ControlNet acting on a row adds its share; a row at a DeepCache cached step
costs its shallow branch's share instead of 1; a first-block row costs 1 (it decides inside the
forward whether it runs the blocks after the first). A share is floating-point operations per row
against the denoiser's, counted once per latent shape (and ControlNet) by ``FlopCounterMode`` on fake
tensors: nothing is computed or allocated. A forward's time and its activations both grow with
them, so ControlNet traffic is not over-admitted, and a forward that ran out of memory with
ControlNets lowers the shape's limit by what it cost, not by its row count.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from handler.engine.jobs import DenoiseJob, JobSpec
from handler.engine.step_engine import StepEngine
from handler.families import Conditioning
from handler.families.deep_cache import Branch, RowCache, shallow_share

logger = logging.getLogger(__name__)
Shape = tuple[int, ...]


@dataclass
class _ShapeCosts:
    """One latent shape's inputs of one row (what fake tensors are made from) and its shares."""

    latents: torch.Tensor
    timestep: torch.Tensor
    conditioning: Conditioning
    side: tuple[int, int]  # the images' height and width (a control image's size)
    flops: float  # the denoiser's per row
    by_module: dict[str, float]
    shallow: dict[Branch, float] = field(default_factory=dict)
    controlnets: dict[str, float] = field(default_factory=dict)


class RowCosts:
    """Per latent shape, what a job's rows cost; shapes not counted yet cost their row count."""

    def __init__(self, engine: StepEngine):
        self.engine = engine
        self._shapes: dict[Shape, _ShapeCosts] = {}

    def count(self, job: DenoiseJob) -> None:
        """Count the denoiser's operations per row of the job's latent shape, from its first row
        (once per shape; the UNet families only: only they take ControlNets or DeepCache)."""
        shape = job.latent_shape
        if shape in self._shapes or not self.engine.family.rules.controlnets:
            return
        latents, timestep = job.latents[:1], job.timesteps[:1].float()
        conditioning = job.conditioning.rows(slice(0, 1))
        family = self.engine.family
        flops, by_module = _flops(lambda: family.forward(latents, timestep, conditioning, None))
        self._shapes[shape] = _ShapeCosts(
            latents, timestep, conditioning, (job.spec.height, job.spec.width), flops, by_module
        )
        logger.info("row costs %s: %.3g GFLOP per denoiser row", shape, flops / 1e9)

    def of(self, job: DenoiseJob) -> float:
        """What the job's rows cost in its next step."""
        costs = self._shapes.get(job.latent_shape)
        if costs is None:
            return float(job.rows)
        base = self._shallow(costs, job.cache.branch) if job.cached_step and isinstance(job.cache, RowCache) else 1.0
        return job.rows * (base + sum(self._controlnet(costs, control.spec.net) for control in job.acting()))

    def at_start(self, spec: JobSpec, shape: Shape) -> float:
        """What a job of ``spec`` costs in its first step (every ControlNet it names acting)."""
        costs = self._shapes.get(shape)
        if costs is None:
            return float(spec.rows)
        return spec.rows * (1.0 + sum(self._controlnet(costs, control.net) for control in spec.controls))

    def _shallow(self, costs: _ShapeCosts, branch: Branch) -> float:
        if branch not in costs.shallow:
            costs.shallow[branch] = shallow_share(self.engine.family.denoiser, costs.by_module, branch)
        return costs.shallow[branch]

    def _controlnet(self, costs: _ShapeCosts, net_id: str) -> float:
        if net_id not in costs.controlnets:
            height, width = costs.side
            controlnets, latents = self.engine.controlnets, costs.latents

            def call() -> Any:
                image = torch.zeros((1, 3, height, width), dtype=latents.dtype, device=latents.device)
                return controlnets.run(net_id, latents, costs.timestep, costs.conditioning, image)

            flops, _ = _flops(call)
            costs.controlnets[net_id] = flops / costs.flops
            logger.info("row costs: ControlNet %s adds %.2f of a denoiser row", net_id, costs.controlnets[net_id])
        return costs.controlnets[net_id]


def _flops(call: Callable[[], Any]) -> tuple[float, dict[str, float]]:
    """The operations of ``call`` on fake tensors (its real inputs and weights stand in as fakes), in
    all and per module; a compiled module runs its eager code."""
    with (
        torch.compiler.set_stance("force_eager"),
        torch.inference_mode(),
        FakeTensorMode(allow_non_fake_inputs=True),
        FlopCounterMode(display=False) as counter,
    ):
        call()
    by_module = {name: float(sum(ops.values())) for name, ops in counter.get_flop_counts().items()}
    return float(counter.get_total_flops()), by_module
