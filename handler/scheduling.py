"""Which jobs take the next UNet forward: the step-time profile and deadline slack.

``StepProfile`` measures, per latent shape, the seconds of one step at batch 1, 2, 4, ... images
and derives the batch cap: the smallest batch whose per-image step time is within ``PROFILE_GAIN``
of the best (beyond it a larger batch only adds latency). It also remembers what did not fit in
memory, so a request known to be too large alone is refused at admission. ``choose`` picks the
latent shape of the job with the least slack (time to its deadline minus the estimated time of
its remaining steps) and, within it, the least-slack jobs up to the cap.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from handler.engine import DenoiseJob, JobSpec, StepEngine
from handler.pipeline import release_cached_memory, synchronize

logger = logging.getLogger(__name__)

# A larger batch is worth it while it cuts the per-image step time by at least this fraction.
PROFILE_GAIN = 0.05
Shape = tuple[int, ...]


class StepProfile:
    """Measured step seconds per latent shape and batch (in images), the batch cap they imply, and
    the memory limits seen."""

    def __init__(self, engine: StepEngine, max_images: int):
        self.engine = engine
        self.max_images = max_images
        self.seconds: dict[Shape, dict[int, float]] = {}
        self.memory_caps: dict[Shape, int] = {}
        self.too_large: dict[Shape, int] = {}

    def sizes(self) -> list[int]:
        """Batch sizes measured: 1, 2, 4, ... up to ``max_images``."""
        sizes, size = [], 1
        while size < self.max_images:
            sizes.append(size)
            size *= 2
        return sizes + [self.max_images]

    def measure(self, width: int, height: int) -> dict[int, float]:
        """Time one step at each batch size for this image size (two steps each: the first may
        allocate or compile). Running out of memory at a size caps the shape below it."""
        shape = self.engine.latent_shape(width, height)
        timings = {}
        for size in self.sizes():
            job = self.engine.start(JobSpec("profile", None, tuple(range(size)), width, height, 2, "ddim", 7.5))
            try:
                self.engine.step([job])
                started = time.perf_counter()
                self.engine.step([job])
                synchronize(self.engine.device)
            except torch.OutOfMemoryError:
                release_cached_memory()
                self.ran_out_of_memory(shape, size, alone=True)
                break
            timings[size] = time.perf_counter() - started
        self.seconds[shape] = timings
        logger.info("step-time profile %s: %s; cap %d images", shape, {k: round(v, 4) for k, v in timings.items()}, self.cap(shape))
        return timings

    def measured(self, shape: Shape) -> bool:
        return shape in self.seconds

    def cap(self, shape: Shape) -> int:
        """The most images one forward of this shape steps."""
        timings = self.seconds.get(shape)
        if not timings:
            return min(self.max_images, self.memory_caps.get(shape, self.max_images))
        best = min(seconds / size for size, seconds in timings.items())
        fastest = min(size for size, seconds in timings.items() if seconds / size <= best * (1 + PROFILE_GAIN))
        return max(1, min(fastest, self.memory_caps.get(shape, fastest)))

    def ran_out_of_memory(self, shape: Shape, images: int, alone: bool) -> None:
        """``images`` images of this shape did not fit in one forward: never step more than half
        as many again; ``alone``: a single job of that many cannot be stepped at all."""
        half = max(1, images // 2)
        self.memory_caps[shape] = min(half, self.memory_caps.get(shape, half))
        if alone:
            self.too_large[shape] = min(images, self.too_large.get(shape, images))

    def fits(self, shape: Shape, images: int) -> bool:
        """False when a job of this many images of this shape already ran out of memory alone."""
        return images < self.too_large.get(shape, images + 1)

    def step_seconds(self, shape: Shape, images: int) -> float:
        """Estimated seconds of one step of ``images`` images (nearest measured batch at or above)."""
        timings = self.seconds.get(shape)
        if not timings:
            return 0.0
        size = min((size for size in timings if size >= images), default=max(timings))
        return timings[size]


def slack(job: DenoiseJob, deadline: float, now: float, profile: StepProfile) -> float:
    """Seconds to spare: time to the deadline minus the estimated time of the remaining steps."""
    shape = job.latent_shape
    per_step = profile.step_seconds(shape, profile.cap(shape))
    return deadline - now - (job.total_steps - job.step) * per_step


def choose(waiting: dict[str, DenoiseJob], slacks: dict[str, float], cap: Callable[[Shape], int]) -> list[str]:
    """The jobs (by id) that take the next forward: the latent shape of the least-slack job, and
    within it the least-slack jobs while their images fit the shape's cap (a job larger than the
    cap goes alone)."""
    if not waiting:
        return []
    order = sorted(waiting, key=lambda name: slacks[name])
    shape = waiting[order[0]].latent_shape
    limit, images, chosen = cap(shape), 0, []
    for name in order:
        job = waiting[name]
        if job.latent_shape != shape:
            continue
        if chosen and images + job.images > limit:
            break
        chosen.append(name)
        images += job.images
    return chosen
