"""Run step-engine jobs to completion in-process, as the service runs a batch of one shape: every
job in each denoiser forward until all are done, then one decode. For benchmarks and tests that need
images or step times without a server."""

from __future__ import annotations

import torch

from handler.engine.jobs import DenoiseJob, JobSpec
from handler.engine.step_engine import StepEngine
from handler.engine.timing import StepTimer
from handler.families import Decoded


def generate(engine: StepEngine, specs: list[JobSpec]) -> tuple[list[Decoded], list[float]]:
    """Decoded images per job (all of one size), and the seconds of each forward (``finish``)."""
    return finish(engine, engine.start(specs))


def finish(engine: StepEngine, jobs: list[DenoiseJob]) -> tuple[list[Decoded], list[float]]:
    """Started jobs (all of one size) run to completion: their decoded images, and the seconds of
    each forward (device time on CUDA, timed as the service times its steps: no synchronization in
    a step). The jobs not done take one forward each step whatever their LoRA sets, as the service
    steps them."""
    timer, step_seconds = StepTimer(engine.device), []
    while not all(job.done for job in jobs):
        started = timer.start()
        engine.step([job for job in jobs if not job.done])
        timer.stop(started, step_seconds.append)
    timer.collect(wait=True)
    decoded = engine.decode(torch.cat([job.latents for job in jobs]), jobs[0].spec.width, jobs[0].spec.height)
    return decoded.split([job.images for job in jobs]), step_seconds
