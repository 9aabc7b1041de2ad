"""Which jobs take the next denoiser forward: the step-time profile and deadline slack.

Sizes are counted in denoiser rows, what a forward's time and memory grow with: an image is two rows
with classifier-free guidance, one without, and a row costs more with ControlNets acting and less at
a DeepCache cached step (``handler.engine.costs``: caps and limits are in plain rows). ``StepProfile``
measures, per latent shape, the seconds of one step at 1, 2, 4, ... guided images and derives the
batch cap: the fewest rows whose per-row step time is within ``PROFILE_GAIN`` of the best (beyond it
a larger batch only adds latency). It also remembers what did not fit in memory, so a job known to
be too large alone is refused at admission. ``choose`` picks the latent shape of the job with the
least slack (time to its deadline minus the estimated time of its remaining steps) and, within it,
the least-slack jobs that fit the cap.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from handler.config import SchedulerName, StepCache
from handler.engine.costs import Cost, RowCosts
from handler.engine.jobs import DenoiseJob, JobSpec
from handler.engine.loading import release_cached_memory, synchronize
from handler.engine.step_engine import StepEngine

logger = logging.getLogger(__name__)

# A larger batch is worth it while it cuts the per-image step time by at least this fraction.
PROFILE_GAIN = 0.05
Shape = tuple[int, ...]


class StepProfile:
    """Measured step seconds per latent shape and batch (in denoiser rows), the batch cap they imply,
    and the memory limits seen."""

    def __init__(self, engine: StepEngine, max_images: int, scheduler: SchedulerName = "ddim", time_cap: bool = True):
        self.engine = engine
        self.time_cap = time_cap  # False: only memory caps a forward
        self.max_rows = 2 * max_images  # guided images
        self.scheduler = scheduler  # what the profile's jobs step with (one the model's family serves)
        self.seconds: dict[Shape, dict[int, float]] = {}
        self.memory_caps: dict[Shape, float] = {}  # in plain rows (costs)
        self.too_large: dict[Shape, float] = {}
        self.costs = RowCosts(engine)

    def sizes(self) -> list[int]:
        """Guided images measured: 1, 2, 4, ... up to the most images a forward steps."""
        most, sizes, size = self.max_rows // 2, [], 1
        while size < most:
            sizes.append(size)
            size *= 2
        return sizes + [most]

    def measure(self, width: int, height: int) -> dict[int, float]:
        """Time one step at each size for this image size: the last of a job's steps, after the ones
        that may allocate, compile or record (``untimed_steps``). Running out of memory at a size caps
        the shape below it."""
        shape = self.engine.latent_shape(width, height)
        timings: dict[int, float] = {}
        for size in self.sizes():
            job = self._job(size, width, height, steps=self.untimed_steps() + 1)
            self.costs.count(job)
            if not self._timed_steps(job, timings):
                release_cached_memory()  # outside the except block: the failed forward's tensors are gone
                self.ran_out_of_memory(shape, job.rows, alone=True, padding=self.engine.padding([job]))
                break
        self.seconds[shape] = timings
        logger.info(
            "step-time profile %s: %s; cap %g rows",
            shape,
            {k: round(v, 4) for k, v in timings.items()},
            self.cap(shape),
        )
        return timings

    def step_each_size(self, width: int, height: int, cache: StepCache | None = None) -> None:
        """Step a two-step job at each size the profile measured for this image size (cached with
        ``cache``: a full step, then a cached one), untimed, so that a compiled denoiser compiles
        the graphs of those row counts now rather than for a request: under
        ``LoraSlots.lora_graph`` its graph with LoRA rows, with a cache its regions."""
        shape = self.engine.latent_shape(width, height)
        for rows in list(self.seconds.get(shape, {})):
            job = self._job(rows // 2, width, height, cache)
            try:
                while not job.done:
                    self.engine.step([job])
            except torch.OutOfMemoryError:
                logger.warning("warm-up: %d rows ran out of memory; larger row counts compile on first use", rows)
                break
        else:
            return
        del job  # its kept outputs too
        release_cached_memory()  # outside the except block: the failed forward's tensors are gone

    def untimed_steps(self) -> int:
        """Steps of a row count before one that times what serving runs: the first may allocate or
        compile; where the denoiser replays CUDA graphs (cudagraph trees), the first call of a graph
        warms it up and the second records it, and only the third replays."""
        return 2 if self.engine.cuda_graphs else 1

    def _job(self, size: int, width: int, height: int, cache: StepCache | None = None, steps: int = 2) -> DenoiseJob:
        """A profile job: ``size`` guided images of ``steps`` steps."""
        spec = JobSpec("profile", None, tuple(range(size)), width, height, steps, self.scheduler, 7.5, cache=cache)
        (job,) = self.engine.start([spec])
        return job

    def _timed_steps(self, job: DenoiseJob, timings: dict[int, float]) -> bool:
        """Time the last step of ``job`` into ``timings`` (by rows); False when out of memory."""
        try:
            while job.step < job.total_steps - 1:
                self.engine.step([job])
            synchronize(self.engine.device)  # the earlier steps' device work is not the last's
            started = time.perf_counter()
            self.engine.step([job])
            synchronize(self.engine.device)
        except torch.OutOfMemoryError:
            return False
        timings[job.rows] = time.perf_counter() - started
        return True

    def measured(self, shape: Shape) -> bool:
        return shape in self.seconds

    def cap(self, shape: Shape) -> float:
        """The most rows (plain rows: costs) one forward of this shape steps."""
        timings = self.seconds.get(shape)
        if not timings or not self.time_cap:
            return min(self.max_rows, self.memory_caps.get(shape, self.max_rows))
        best = min(seconds / rows for rows, seconds in timings.items())
        fastest = min(rows for rows, seconds in timings.items() if seconds / rows <= best * (1 + PROFILE_GAIN))
        return max(1, min(fastest, self.memory_caps.get(shape, fastest)))

    def cost(self, job: DenoiseJob) -> Cost:
        """What the job's rows cost in its next step, in plain rows."""
        return self.costs.of(job)

    def limits(self, shape: Shape) -> Cost:
        """What one forward of this shape may cost: the cap in time, what memory has held."""
        return Cost(self.cap(shape), self.memory_caps.get(shape, self.max_rows))

    def padding(self, jobs: list[DenoiseJob]) -> int:
        """The rows the engine pads a forward of ``jobs`` by, as their shape's memory limit counts
        them: once the shape ran out of memory (that limit is then what memory held, padding
        included); before, the limit is the configured most images, which padding rows are not."""
        return self.engine.padding(jobs) if jobs[0].latent_shape in self.memory_caps else 0

    def fits_job(self, spec: JobSpec) -> bool:
        """False when a job like ``spec`` (its most rows, with its ControlNets) already ran out of memory alone."""
        shape = self.engine.latent_shape(spec.width, spec.height)
        return self.fits(shape, self.costs.at_start(spec, shape))

    def ran_out_of_memory(self, shape: Shape, rows: float, *, alone: bool, padding: int) -> None:
        """``rows`` rows (plain rows: costs) of this shape, run with ``padding`` plain rows more (the
        engine's copies up to its row counts), did not fit in one forward: never step more than half
        as many as ran again, padding included (``choose`` counts it); ``alone``: a single job of
        ``rows`` (before padding, as admission counts) cannot be stepped at all."""
        half = max(1.0, (rows + padding) / 2)
        self.memory_caps[shape] = min(half, self.memory_caps.get(shape, half))
        if alone:
            self.too_large[shape] = min(rows, self.too_large.get(shape, rows))

    def fits(self, shape: Shape, rows: float) -> bool:
        """False when a job of this cost (plain rows) of this shape already ran out of memory alone."""
        return rows < self.too_large.get(shape, rows + 1)

    def forward_seconds(self, shape: Shape) -> float:
        """Estimated seconds of one forward of this shape at its cap (what a job's step may take)."""
        return self.step_seconds(shape, self.cap(shape))

    def step_seconds(self, shape: Shape, rows: float) -> float:
        """Estimated seconds of one step of ``rows`` rows (nearest measured size at or above)."""
        timings = self.seconds.get(shape)
        if not timings:
            return 0.0
        size = min((size for size in timings if size >= rows), default=max(timings))
        return timings[size]


def slack(job: DenoiseJob, deadline: float, now: float, profile: StepProfile) -> float:
    """Seconds to spare: time to the deadline minus the estimated time of the remaining steps."""
    return deadline - now - (job.total_steps - job.step) * profile.forward_seconds(job.latent_shape)


def choose(
    waiting: dict[str, DenoiseJob],
    slacks: dict[str, float],
    limits: Callable[[Shape], Cost],
    cost: Callable[[DenoiseJob], Cost] = lambda job: Cost.rows(job.rows),
    padding: Callable[[list[DenoiseJob]], int] = lambda jobs: 0,
) -> list[str]:
    """The jobs (by id) that take the next forward: the latent shape of the least-slack job, then in
    slack order every job of that shape (whatever its LoRA set) whose cost still fits the shape's
    limits in time and memory, in memory with the rows the forward would be padded by (``padding``:
    ``StepProfile.padding``); the least-slack job goes even when it alone is over them."""
    if not waiting:
        return []
    order = sorted(waiting, key=lambda name: slacks[name])
    shape = waiting[order[0]].latent_shape
    limit, time, memory = limits(shape), 0.0, 0.0
    chosen: list[str] = []
    jobs: list[DenoiseJob] = []
    for name in order:
        job, job_cost = waiting[name], cost(waiting[name])
        if job.latent_shape != shape:
            continue
        if chosen and (
            time + job_cost.time > limit.time or memory + job_cost.memory + padding([*jobs, job]) > limit.memory
        ):
            continue
        chosen.append(name)
        jobs.append(job)
        time, memory = time + job_cost.time, memory + job_cost.memory
    return chosen
