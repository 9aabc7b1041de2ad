"""Which pytest-xdist worker runs a test (``make test`` runs two, ``--dist loadgroup``): the tests of
one file run on one worker, and so do all the tests that use a session server
(tests/integration/conftest.py) or the benchmarks' scratch, so each server starts once, a module's
fixtures are built once and a benchmark finds what another one left in the scratch."""

from __future__ import annotations

import pytest

# the shared fixtures, by the group of the tests that use them
SHARED_FIXTURE_GROUPS = {
    "server": "session-servers",
    "dynamic_server": "session-servers",
    "continuous_server": "session-servers",
    "served_dirs": "session-servers",
    "bench_scratch": "benchmark-scratch",
}


def worker_group(item: pytest.Item) -> str:
    """The group of the shared fixtures ``item`` uses, else its file (``unit/test_x`` for
    tests/unit/test_x.py)."""
    shared = {SHARED_FIXTURE_GROUPS[name] for name in item.fixturenames if name in SHARED_FIXTURE_GROUPS}
    if len(shared) > 1:
        raise pytest.UsageError(f"{item.nodeid} uses the fixtures of {sorted(shared)}: make them one group")
    if shared:
        return shared.pop()
    return item.path.with_suffix("").relative_to(item.config.rootpath / "tests").as_posix()


def mark_worker_groups(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.xdist_group(worker_group(item)))
