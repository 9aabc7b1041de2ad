"""The suite's time limit scales with the machine's measured slowness, never below the limit set."""

from __future__ import annotations

import pytest

from tests.harness.suite_clock import additions_seconds, scaled_limit, slowness


def test_a_slower_machine_gets_a_longer_limit_and_a_faster_one_the_limit_set():
    assert slowness([0.30, 0.33, 0.36], reference_s=0.15) == pytest.approx(2.2)
    assert scaled_limit(3600, [0.30, 0.33, 0.36], reference_s=0.15) == pytest.approx(7920)
    assert scaled_limit(3600, [0.10, 0.12, 0.50], reference_s=0.15) == 3600  # the median, never below 1
    assert scaled_limit(3600, [0.15, 0.15], reference_s=0.15) == 3600


def test_the_additions_are_timed_on_this_machine():
    timings = additions_seconds(repeats=2)
    assert len(timings) == 2 and all(timing > 0 for timing in timings)
