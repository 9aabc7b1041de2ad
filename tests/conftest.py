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
a change that makes the suite slow is noticed when it is made, not when CI's limit is reached."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, deadline=None, max_examples=100)
settings.load_profile("ci")

STARTED = pytest.StashKey[float]()
INDUCTOR_CACHE = pytest.StashKey[str]()
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
INDUCTOR_VECTORS_ENV = "TORCHINDUCTOR_VEC_ISA_OK"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--suite-time-limit",
        type=float,
        default=None,
        help="seconds the whole run may take; a longer run fails (make test: 3600)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.stash[INDUCTOR_CACHE] = os.environ[INDUCTOR_CACHE_ENV] = tempfile.mkdtemp(prefix="sd-tests-inductor-")
    os.environ.setdefault(INDUCTOR_VECTORS_ENV, "0")  # read when inductor's config is first imported


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(config.stash[INDUCTOR_CACHE], ignore_errors=True)


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[STARTED] = time.monotonic()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    limit = session.config.getoption("--suite-time-limit")
    took = time.monotonic() - session.config.stash[STARTED]
    if limit is not None and took > limit and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = f"the suite took {took / 60:.1f} minutes, over its limit of {limit / 60:.0f} (--suite-time-limit)"
        if reporter is not None:
            reporter.write_line(message, red=True, bold=True)
