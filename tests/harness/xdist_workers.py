"""``make test``'s pytest-xdist workers (two, ``--dist loadgroup``).

Which worker runs a test: the tests of one file run on one worker, and so do all the tests that use
a session server (tests/integration/conftest.py) or the benchmarks' scratch, so each server starts
once, a module's fixtures are built once and a benchmark finds what another one left in the scratch.
So do the files that find another's graphs in the run's inductor cache when they run after it
(``FILE_GROUPS``). The groups go out to the workers in collection order (``make test`` passes
``--no-loadscope-reorder``): the long ones are integration files, which come first, where xdist's
default order, by number of tests, sent three long single-test files last (one worker ran alone for
the last minutes).

How many threads torch runs: each worker, and each server or benchmark it starts, gets its share of
the cores (``OMP_NUM_THREADS``, unless set). Two processes each spinning OpenMP threads over both of
two cores ran tests/unit/test_engine.py five times slower than with one thread each
(docs/benchmarks.md, "The test suite's time")."""

from __future__ import annotations

import os

import pytest

THREADS_ENV = "OMP_NUM_THREADS"

# the shared fixtures, by the group of the tests that use them
SHARED_FIXTURE_GROUPS = {
    "server": "session-servers",
    "dynamic_server": "session-servers",
    "continuous_server": "session-servers",
    "served_dirs": "session-servers",
    "bench_scratch": "benchmark-scratch",
}
# test files (below tests/, without .py) by the group of the files that share their compiled graphs:
# the unit tests' engine warms up as the served compile test's worker does, and finds its graphs
FILE_GROUPS = {
    "integration/test_compile_cache": "compiled-lora-slots",
    "unit/test_engine_lora_slots": "compiled-lora-slots",
}


def is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def worker_group(item: pytest.Item) -> str:
    """The group of the shared fixtures ``item`` uses or of its file, else its file (``unit/test_x``
    for tests/unit/test_x.py)."""
    file = item.path.with_suffix("").relative_to(item.config.rootpath / "tests").as_posix()
    shared = {SHARED_FIXTURE_GROUPS[name] for name in item.fixturenames if name in SHARED_FIXTURE_GROUPS}
    shared |= {FILE_GROUPS[file]} if file in FILE_GROUPS else set()
    if len(shared) > 1:
        raise pytest.UsageError(f"{item.nodeid} is in the groups {sorted(shared)}: make them one")
    return shared.pop() if shared else file


def mark_worker_groups(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.xdist_group(worker_group(item)))


def share_the_cores(config: pytest.Config) -> None:
    """In the controller of a distributed run (``-n N``), before it starts its workers: torch's threads
    per worker, inherited by the workers and what they start."""
    workers = getattr(config.option, "numprocesses", None)
    if workers and not is_xdist_worker(config):
        os.environ.setdefault(THREADS_ENV, str(max(1, len(os.sched_getaffinity(0)) // workers)))
