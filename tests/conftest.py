"""Hypothesis runs the same examples on every run and every machine: derandomized, with no example
database, so a property that fails in CI fails the same way locally, and passes the same way too.
Each test bounds its own ``max_examples``; no deadline, since a loaded CI machine is slow.

Every ``torch.compile`` of the run, in this process and in the servers and benchmarks it starts,
shares one inductor cache directory made fresh for the run (``TORCHINDUCTOR_CACHE_DIR``), so a graph
two tests compile alike is compiled once; tests that measure a cold compile set a directory of
their own. Inductor keys a CPU kernel by its compile command, include paths included, so pytest must
run the interpreter the servers' workers run (``make test``'s ``.venv``, not a symlink to another
path): else it compiles again what a worker compiled. Inductor's CPU kernels are compiled without vector instructions
(``TORCHINDUCTOR_VEC_ISA_OK=0``, unless set): scalar C++ compiles in a fifth to a third less time here
(docs/benchmarks.md), and the images stay within the tests' rounding tolerance. It changes nothing
on a GPU, whose kernels are Triton's.

``--suite-time-limit SECONDS`` (``make test`` passes 60 minutes) fails a run that took longer, so
a change that makes the suite slow is noticed when it is made, not when CI's limit is reached. The
limit is at the reference speed: a run times a few million Python additions as it starts and as it
ends, and a machine that ran them slower gets the limit times its slowness (``tests.harness.suite_clock``).

``make test`` runs the suite on two pytest-xdist workers, grouped and given their torch threads by
``tests.harness.xdist_workers``: the workers share the controller's inductor cache, and the
controller alone keeps the suite's time."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import pytest
from hypothesis import settings

from tests.harness.suite_clock import additions_seconds, scaled_limit, slowness
from tests.harness.xdist_workers import is_xdist_worker, mark_worker_groups, share_the_cores

settings.register_profile("ci", derandomize=True, database=None, deadline=None, max_examples=100)
settings.load_profile("ci")

STARTED = pytest.StashKey[float]()
SPEED = pytest.StashKey[list[float]]()
VERDICT = pytest.StashKey[tuple[str, bool]]()
INDUCTOR_CACHE = pytest.StashKey[str]()
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
INDUCTOR_VECTORS_ENV = "TORCHINDUCTOR_VEC_ISA_OK"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--suite-time-limit",
        type=float,
        default=None,
        help="seconds the whole run may take at the reference speed, times this machine's slowness; "
        "a longer run fails (make test: 3600)",
    )


def pytest_configure(config: pytest.Config) -> None:
    if not is_xdist_worker(config):  # a worker inherits the controller's cache directory
        config.stash[INDUCTOR_CACHE] = os.environ[INDUCTOR_CACHE_ENV] = tempfile.mkdtemp(prefix="sd-tests-inductor-")
    share_the_cores(config)
    os.environ.setdefault(INDUCTOR_VECTORS_ENV, "0")  # read when inductor's config is first imported


def pytest_unconfigure(config: pytest.Config) -> None:
    if INDUCTOR_CACHE in config.stash:
        shutil.rmtree(config.stash[INDUCTOR_CACHE], ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mark_worker_groups(items)


def timing_the_suite(config: pytest.Config) -> bool:
    return config.getoption("--suite-time-limit") is not None and not is_xdist_worker(config)


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[STARTED] = time.monotonic()
    if timing_the_suite(session.config):
        session.config.stash[SPEED] = additions_seconds()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not timing_the_suite(session.config):
        return
    limit = session.config.getoption("--suite-time-limit")
    took = time.monotonic() - session.config.stash[STARTED]
    timings = session.config.stash[SPEED] + additions_seconds()
    allowed = scaled_limit(limit, timings)
    over = took > allowed and exitstatus == pytest.ExitCode.OK
    if over:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    session.config.stash[VERDICT] = (
        f"the suite took {took / 60:.1f} minutes{', over its limit (--suite-time-limit)' if over else ''}: this "
        f"machine timed its additions at {slowness(timings):.2f} times the reference "
        f"({', '.join(f'{t:.2f}' for t in timings)} s), so the limit was {allowed / 60:.0f} minutes",
        over,
    )


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    """The time verdict after the slowest tests, where the end of a run's output shows it."""
    if VERDICT in config.stash:
        message, over = config.stash[VERDICT]
        terminalreporter.write_line(message, red=over, bold=over)
