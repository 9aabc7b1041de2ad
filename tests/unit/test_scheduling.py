"""The step-time profile's batch cap and memory knowledge (in UNet rows), and the choice of the next
forward."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from handler.engine import scheduling
from handler.engine.costs import Cost
from handler.engine.jobs import DenoiseJob, JobSpec
from handler.engine.scheduling import StepProfile, choose, slack
from handler.engine.step_engine import padded_count
from handler.families import Conditioning
from tests.harness.stand_ins import SolidColorEngine

SMALL, LARGE = (4, 8, 8), (4, 16, 16)


def profile(timings: dict[int, float] | None = None, max_images: int = 16) -> StepProfile:
    measured = StepProfile(engine=None, max_images=max_images)
    if timings is not None:
        measured.seconds[SMALL] = timings
    return measured


def job(images: int = 1, side: int = 64, steps: int = 10, done_steps: int = 0) -> DenoiseJob:
    spec = JobSpec("p", None, tuple(range(images)), side, side, steps, "ddim", 7.5)
    latents = torch.zeros(images, 4, side // 8, side // 8)
    return DenoiseJob(
        spec, None, torch.arange(steps), latents, Conditioning(torch.zeros(2 * images, 1, 1)), step=done_steps
    )


def test_sizes_double_up_to_the_most_images():
    assert profile(max_images=16).sizes() == [1, 2, 4, 8, 16]
    assert profile(max_images=12).sizes() == [1, 2, 4, 8, 12]
    assert profile(max_images=1).sizes() == [1]


def test_the_cap_is_the_fewest_rows_within_five_percent_of_the_best_per_row_time():
    assert profile({2: 1.0, 4: 1.0, 8: 1.2, 16: 2.4, 32: 4.8}).cap(SMALL) == 8  # 0.15/row from 8 rows on
    assert profile({2: 1.0, 4: 2.0, 8: 4.0}).cap(SMALL) == 2  # no gain from batching
    assert profile({2: 1.0, 4: 1.0, 8: 1.0, 16: 1.0}).cap(SMALL) == 16
    assert profile().cap(LARGE) == 32  # not measured: 16 guided images, the configured most


def test_without_the_step_time_cap_only_memory_caps_a_forward():
    measured = StepProfile(engine=None, max_images=16, time_cap=False)
    measured.seconds[SMALL] = {2: 1.0, 4: 2.0, 8: 4.0}  # no gain from batching: the time cap would be 2 rows
    assert measured.cap(SMALL) == 32
    measured.ran_out_of_memory(SMALL, 16, alone=False, padding=0)
    assert measured.cap(SMALL) == 8


def test_running_out_of_memory_caps_the_shape_and_remembers_what_cannot_run_alone():
    measured = profile({2: 1.0, 4: 1.0, 8: 1.0, 16: 1.0})
    measured.ran_out_of_memory(SMALL, 16, alone=False, padding=0)
    assert measured.cap(SMALL) == 8 and measured.fits(SMALL, 16)
    measured.ran_out_of_memory(SMALL, 6, alone=True, padding=0)  # three guided images, or six unguided
    assert measured.cap(SMALL) == 3 and not measured.fits(SMALL, 6) and not measured.fits(SMALL, 8)
    assert measured.fits(SMALL, 4) and measured.fits(LARGE, 100)


def test_a_padded_forward_that_ran_out_of_memory_caps_the_shape_at_half_the_rows_it_ran():
    """9 rows padded to 16 did not fit: forwards of up to 8 rows, not 4.5; admission still refuses
    a job by its own rows."""
    measured = profile({2: 1.0, 4: 1.0, 8: 1.0, 16: 1.0, 32: 1.0})
    measured.ran_out_of_memory(SMALL, 9, alone=False, padding=7)
    assert measured.cap(SMALL) == 8
    measured.ran_out_of_memory(SMALL, 3, alone=True, padding=1)  # one row copied: four ran
    assert measured.cap(SMALL) == 2 and not measured.fits(SMALL, 3) and measured.fits(SMALL, 2)


def test_step_seconds_come_from_the_nearest_measured_size_at_or_above():
    measured = profile({2: 0.1, 4: 0.15, 8: 0.2})
    assert measured.step_seconds(SMALL, 6) == 0.2 and measured.step_seconds(SMALL, 18) == 0.2
    assert measured.step_seconds(LARGE, 2) == 0.0


def test_slack_is_time_to_the_deadline_minus_the_remaining_steps():
    measured = profile({2: 0.5, 4: 0.5})  # cap 4 rows, 0.5 s a step
    assert slack(job(steps=10, done_steps=4), deadline=10.0, now=2.0, profile=measured) == 10.0 - 2.0 - 6 * 0.5


def test_choose_takes_the_least_slack_shape_then_least_slack_jobs_that_fit_the_cap():
    waiting = {"a": job(2), "b": job(1, side=128), "c": job(1), "d": job(3), "e": job(1)}  # guided: 2 rows an image
    slacks = {"a": 3.0, "b": 0.5, "c": 1.0, "d": 2.0, "e": 4.0}
    assert choose(waiting, slacks, lambda shape: Cost.rows(16)) == ["b"]
    slacks["b"] = 9.0
    assert choose(waiting, slacks, lambda shape: Cost.rows(8)) == ["c", "d"]  # 2 + 6 rows; a and e would exceed
    assert choose(waiting, slacks, lambda shape: Cost.rows(4)) == ["c", "e"]  # d and a do not fit, e still does
    assert choose(waiting, slacks, lambda shape: Cost.rows(1)) == ["c"]
    assert choose({"big": job(6)}, {"big": 0.0}, lambda shape: Cost.rows(2)) == ["big"]  # larger than the cap: alone
    assert choose({}, {}, lambda shape: Cost.rows(2)) == []


def test_choose_keeps_a_forward_within_the_time_and_the_memory_limits():
    """Cheap rows in time (a DeepCache cached step) still fill the memory limit by their count."""
    waiting = {"a": job(2), "b": job(2), "c": job(2)}  # 4 rows each
    slacks = {"a": 1.0, "b": 2.0, "c": 3.0}
    cheap = lambda one: Cost(0.1 * one.rows, one.rows)  # noqa: E731
    assert choose(waiting, slacks, lambda shape: Cost(4, 100), cheap) == ["a", "b", "c"]
    assert choose(waiting, slacks, lambda shape: Cost(4, 8), cheap) == ["a", "b"]


def test_choose_counts_the_rows_a_forward_is_padded_by_against_the_memory_limit():
    """Row counts 2, 8, 32 (a gap over twice): after 4 rows padded to 8 ran out of memory (limit 4),
    a second guided image would be padded to 8 rows again, so a forward takes one; at a limit of 8,
    two, three (6 rows padded to 8) and four images fit, a fifth (10 rows padded to 32) does not."""
    waiting = {name: job(1) for name in "abcde"}  # 2 rows each
    slacks = {name: float(index) for index, name in enumerate(waiting)}

    def padding(jobs: list[DenoiseJob]) -> int:
        rows = sum(one.rows for one in jobs)
        return padded_count(rows, (2, 8, 32)) - rows

    measured = profile({2: 1.0, 4: 1.0, 8: 1.0, 16: 1.0, 32: 1.0})
    measured.ran_out_of_memory(SMALL, 4, alone=False, padding=4)
    assert choose(waiting, slacks, measured.limits, padding=padding) == ["a"]
    assert choose(waiting, slacks, lambda shape: Cost.rows(8), padding=padding) == ["a", "b", "c", "d"]
    assert choose(waiting, slacks, lambda shape: Cost.rows(4)) == ["a", "b"], "unpadded: the rows alone"


def test_the_profile_counts_padding_against_memory_once_the_shape_ran_out_of_memory():
    """Before, a shape's memory limit is the configured most images, which padding rows are not."""
    measured = StepProfile(engine=SimpleNamespace(padding=lambda jobs: 6), max_images=16)
    assert measured.padding([job(1)]) == 0
    measured.ran_out_of_memory(SMALL, 10, alone=False, padding=6)
    assert measured.padding([job(1)]) == 6 and measured.padding([job(1, side=128)]) == 0


class CompilingEngine(SolidColorEngine):
    """Steps on a clock of their own: a row count's calls take ``seconds`` in turn, then its last."""

    def __init__(self, cuda_graphs: bool, seconds: tuple[float, ...]):
        super().__init__()
        self.cuda_graphs, self.seconds = cuda_graphs, seconds
        self.now, self.calls = 0.0, Counter()

    def step(self, jobs: list[DenoiseJob]) -> int:
        rows = sum(job.rows for job in jobs)
        self.now += self.seconds[min(self.calls[rows], len(self.seconds) - 1)]
        self.calls[rows] += 1
        return super().step(jobs)


@pytest.mark.parametrize(
    ("cuda_graphs", "seconds"),
    [(False, (10.0, 0.1)), (True, (10.0, 5.0, 0.1))],  # compiles, then runs; warms up, records, then replays
    ids=["compiled", "cuda-graphs"],
)
def test_the_profile_times_a_step_of_what_serving_runs_after_compiling_and_recording(cuda_graphs, seconds, monkeypatch):
    """Under cudagraph trees a graph's first call warms it up and its second records it: the
    profile's job takes a step more, and the step it times replays."""
    engine = CompilingEngine(cuda_graphs, seconds)
    monkeypatch.setattr(scheduling, "time", SimpleNamespace(perf_counter=lambda: engine.now))
    measured = StepProfile(engine, max_images=4)
    assert measured.measure(64, 64) == pytest.approx({2: 0.1, 4: 0.1, 8: 0.1})
    assert set(engine.calls.values()) == {len(seconds)}
