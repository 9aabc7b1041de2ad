"""The suite's time limit at this machine's speed.

The 2-core development machine and CI's run the same code at speeds two times apart from one day to
the next (docs/benchmarks.md, "The test suite's time"), so a limit in wall-clock minutes trips on a
slow day and blocks every change, whichever was slow. ``make test``'s limit is set at the reference
speed; a run on a slower machine gets the limit times how much slower it measured, never less."""

from __future__ import annotations

import statistics
import time

ADDITIONS = 5_000_000
# The seconds ADDITIONS Python additions take on the development machine at its speed of 2026-12-06,
# when `import handler.sd_handler` took 5.9 s and the tiny UNet's first compile 27.4 s: at 15:40 to 15:50 UTC
# on 2026-12-07 they took 14.0 s and 61 to 66 s (2.2 to 2.4 times as long), and the additions 0.30
# to 0.37 s (median 0.33).
REFERENCE_S = 0.15


def additions_seconds(repeats: int = 3) -> list[float]:
    """``repeats`` timings of ``ADDITIONS`` Python additions: the interpreter-bound work most of the
    suite is (imports, tracing, code generation), timed on this machine now."""
    timings = []
    for _ in range(repeats):
        started, total = time.perf_counter(), 0
        for number in range(ADDITIONS):
            total += number
        timings.append(time.perf_counter() - started)
    return timings


def slowness(timings: list[float], reference_s: float = REFERENCE_S) -> float:
    """How many times slower than the reference this machine ran (the median timing), at least 1."""
    return max(1.0, statistics.median(timings) / reference_s)


def scaled_limit(limit_s: float, timings: list[float], reference_s: float = REFERENCE_S) -> float:
    """The suite's limit at the speed ``timings`` measured: ``limit_s`` at the reference speed."""
    return limit_s * slowness(timings, reference_s)
