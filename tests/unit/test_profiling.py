"""The device's busy time in a profile: kernels of several streams that overlap count once."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from handler.engine.profiling import busy_seconds


def test_overlapping_kernels_count_once_and_gaps_not_at_all():
    # the step's kernels 0..400 us and 500..900, the decode stream's 300..600, one inside it
    intervals = [(500.0, 900.0), (0.0, 400.0), (300.0, 600.0), (350.0, 360.0)]
    assert busy_seconds(intervals) == pytest.approx(900e-6)
    assert busy_seconds([(0.0, 100.0), (200.0, 300.0)]) == pytest.approx(200e-6)
    assert busy_seconds([]) == 0.0


interval = st.tuples(st.floats(0, 1e6), st.floats(0, 1e4)).map(lambda pair: (pair[0], pair[0] + pair[1]))


@given(st.lists(interval, max_size=30))
def test_the_busy_time_lies_between_the_longest_kernel_and_the_sum_of_them(intervals):
    busy = busy_seconds(intervals) * 1e6
    lengths = [end - start for start, end in intervals]
    assert max(lengths, default=0.0) - 1e-6 <= busy <= sum(lengths) + 1e-6
    span = max((end for _, end in intervals), default=0.0) - min((start for start, _ in intervals), default=0.0)
    assert busy <= span + 1e-6
