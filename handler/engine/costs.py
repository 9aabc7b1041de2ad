"""What a job's rows cost in one denoiser forward, in plain rows of its latent shape: the units of the
step-time profile's cap and of the memory limits it learns (``handler.engine.scheduling``).

Time: a plain row costs 1. Each ControlNet acting on a row adds its share; a row at a DeepCache
cached step costs its shallow branch's share instead of 1; a first-block row costs 1 (it decides
inside the forward whether it runs the blocks after the first). A share is floating-point
operations per row against the denoiser's, counted once per latent shape (and ControlNet) by
``FlopCounterMode`` on fake tensors (attention as its two matrix products, whichever kernel the
device picks, so CPU and GPU count alike): nothing is computed or allocated.

Memory: the time cost, but never less than the rows. A ControlNet's activations come on top of the
denoiser's, as its operations do; a cached step's shallow branch runs at full resolution, where most
activations are, so its memory does not shrink with its operations. So ControlNet traffic is not
over-admitted, a forward with ControlNets that runs out of memory lowers the shape's limit by what
it cost, and cached rows never pack more rows into a forward than memory has held.

Where the operations cannot be counted (a denoiser under accelerate's CPU offload, whose hooks
would move fake weights; or a counting failure), rows cost their count and a ControlNet a row.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from handler.engine.jobs import DenoiseJob, JobSpec
from handler.engine.step_engine import StepEngine
from handler.families import Conditioning
from handler.families.deep_cache import Branch, RowCache, shallow_share

logger = logging.getLogger(__name__)
Shape = tuple[int, ...]
UNCOUNTED_CONTROLNET = 1.0  # a ControlNet whose operations could not be counted: as much as the denoiser


class Cost(NamedTuple):
    """A job's next step, or a shape's limits, in plain rows."""

    time: float
    memory: float

    @classmethod
    def rows(cls, rows: float) -> Cost:
        return cls(rows, rows)


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
        (once per shape, where the family takes ControlNets: what their shares are counted against)."""
        shape, family = job.latent_shape, self.engine.family
        if shape in self._shapes or not family.rules.controlnets or hasattr(family.denoiser, "_hf_hook"):
            return
        latents, timestep = job.latents[:1], job.timesteps[:1].float()
        conditioning = job.conditioning.rows(slice(0, 1))
        try:
            flops, by_module = _flops(lambda: family.forward(latents, timestep, conditioning, None))
        except Exception:  # noqa: BLE001 - the shape's rows then cost their count
            logger.exception(
                "row costs %s: the denoiser's operations could not be counted; rows cost their count", shape
            )
            return
        side = (job.spec.height, job.spec.width)
        self._shapes[shape] = _ShapeCosts(latents, timestep, conditioning, side, flops, by_module)
        logger.info("row costs %s: %.3g GFLOP per denoiser row", shape, flops / 1e9)

    def of(self, job: DenoiseJob) -> Cost:
        """What the job's rows cost in its next step."""
        costs = self._shapes.get(job.latent_shape)
        if costs is None:
            return Cost.rows(job.rows)
        base = self._shallow(costs, job.cache.branch) if job.cached_step and isinstance(job.cache, RowCache) else 1.0
        time = job.rows * (base + sum(self._controlnet(costs, control.spec.net) for control in job.acting()))
        return Cost(time, max(time, job.rows))

    def at_start(self, spec: JobSpec, shape: Shape) -> float:
        """What a job of ``spec`` costs at its costliest step (every ControlNet it names acting, its
        skip-layer rows joined; time and memory alike)."""
        costs = self._shapes.get(shape)
        if costs is None:
            return float(spec.most_rows)
        return spec.most_rows * (1.0 + sum(self._controlnet(costs, control.net) for control in spec.controls))

    def _shallow(self, costs: _ShapeCosts, branch: Branch) -> float:
        if branch not in costs.shallow:
            costs.shallow[branch] = shallow_share(self.engine.family.denoiser, costs.by_module, branch)
        return costs.shallow[branch]

    def _controlnet(self, costs: _ShapeCosts, net_id: str) -> float:
        if net_id not in costs.controlnets:
            height, width = costs.side
            controlnets, latents = self.engine.controlnets, costs.latents

            def call() -> Any:
                blank = self.engine.family.control_placeholder(latents, height, width)
                return controlnets.run(net_id, latents, costs.timestep, costs.conditioning, blank)

            try:
                share = _flops(call)[0] / costs.flops
            except Exception:  # noqa: BLE001 - counted as a whole row instead
                logger.exception("row costs: ControlNet %s's operations could not be counted; it costs a row", net_id)
                share = UNCOUNTED_CONTROLNET
            costs.controlnets[net_id] = share
            logger.info("row costs: ControlNet %s adds %.2f of a denoiser row", net_id, share)
        return costs.controlnets[net_id]


def _fused_attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """The CPU's fused attention kernel, which ``FlopCounterMode`` has no formula for, counted as
    its formula for the GPU's kernels counts them (the math path's two matrix products)."""
    return sdpa_flop_count(query_shape, key_shape, value_shape)


# Counted whichever kernel a call picks, so counting changes no process-wide attention setting: on a
# GPU the encoder threads' safety checkers run attention while the stepping thread counts.
ATTENTION_FORMULAS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _fused_attention_flops}


def _flops(call: Callable[[], Any]) -> tuple[float, dict[str, float]]:
    """The operations of ``call`` on fake tensors (its real inputs and weights stand in as fakes), in
    all and per module; a compiled module runs its eager code."""
    with (
        torch.compiler.set_stance("force_eager"),
        torch.inference_mode(),
        FakeTensorMode(allow_non_fake_inputs=True),
        FlopCounterMode(display=False, custom_mapping=ATTENTION_FORMULAS) as counter,
    ):
        call()
    by_module = {name: float(sum(ops.values())) for name, ops in counter.get_flop_counts().items()}
    return float(counter.get_total_flops()), by_module
