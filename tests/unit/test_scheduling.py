"""The step-time profile's batch cap and memory knowledge, and the choice of the next forward."""

from __future__ import annotations

import torch

from handler.engine import DenoiseJob, JobSpec
from handler.families import Conditioning
from handler.scheduling import StepProfile, choose, slack

SMALL, LARGE = (4, 8, 8), (4, 16, 16)


def profile(timings: dict[int, float] | None = None, max_images: int = 16) -> StepProfile:
    measured = StepProfile(engine=None, max_images=max_images)
    if timings is not None:
        measured.seconds[SMALL] = timings
    return measured


def job(images: int = 1, side: int = 64, steps: int = 10, done_steps: int = 0) -> DenoiseJob:
    spec = JobSpec("p", None, tuple(range(images)), side, side, steps, "ddim", 7.5)
    latents = torch.zeros(images, 4, side // 8, side // 8)
    return DenoiseJob(spec, None, torch.arange(steps), latents, Conditioning(torch.zeros(2 * images, 1, 1)), step=done_steps)


def test_sizes_double_up_to_the_most_images():
    assert profile(max_images=16).sizes() == [1, 2, 4, 8, 16]
    assert profile(max_images=12).sizes() == [1, 2, 4, 8, 12]
    assert profile(max_images=1).sizes() == [1]


def test_the_cap_is_the_smallest_batch_within_five_percent_of_the_best_per_image_time():
    assert profile({1: 1.0, 2: 1.0, 4: 1.2, 8: 2.4, 16: 4.8}).cap(SMALL) == 4  # 0.30/image from 4 on
    assert profile({1: 1.0, 2: 2.0, 4: 4.0}).cap(SMALL) == 1  # no gain from batching
    assert profile({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}).cap(SMALL) == 8
    assert profile().cap(LARGE) == 16  # not measured: the configured most


def test_running_out_of_memory_caps_the_shape_and_remembers_what_cannot_run_alone():
    measured = profile({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0})
    measured.ran_out_of_memory(SMALL, 8, alone=False)
    assert measured.cap(SMALL) == 4 and measured.fits(SMALL, 8)
    measured.ran_out_of_memory(SMALL, 3, alone=True)
    assert measured.cap(SMALL) == 1 and not measured.fits(SMALL, 3) and not measured.fits(SMALL, 4)
    assert measured.fits(SMALL, 2) and measured.fits(LARGE, 100)


def test_step_seconds_come_from_the_nearest_measured_batch_at_or_above():
    measured = profile({1: 0.1, 2: 0.15, 4: 0.2})
    assert measured.step_seconds(SMALL, 3) == 0.2 and measured.step_seconds(SMALL, 9) == 0.2
    assert measured.step_seconds(LARGE, 1) == 0.0


def test_slack_is_time_to_the_deadline_minus_the_remaining_steps():
    measured = profile({1: 0.5, 2: 0.5})  # cap 2, 0.5 s a step
    assert slack(job(steps=10, done_steps=4), deadline=10.0, now=2.0, profile=measured) == 10.0 - 2.0 - 6 * 0.5


def test_choose_takes_the_least_slack_shape_then_least_slack_jobs_up_to_the_cap():
    waiting = {"a": job(2), "b": job(1, side=128), "c": job(1), "d": job(3), "e": job(1)}
    slacks = {"a": 3.0, "b": 0.5, "c": 1.0, "d": 2.0, "e": 4.0}
    assert choose(waiting, slacks, lambda shape: 8) == ["b"]
    slacks["b"] = 9.0
    assert choose(waiting, slacks, lambda shape: 4) == ["c", "d"]  # c (1) + d (3) = 4; a would exceed
    assert choose(waiting, slacks, lambda shape: 1) == ["c"]
    assert choose({"big": job(6)}, {"big": 0.0}, lambda shape: 2) == ["big"]  # larger than the cap: alone
    assert choose({}, {}, lambda shape: 2) == []
