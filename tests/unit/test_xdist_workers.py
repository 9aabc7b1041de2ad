"""``make test``'s two pytest-xdist workers, as tests.harness.xdist_workers sets them up: run on a small
suite of its own, with the project's pinned pytest and pytest-xdist, the tests of a session server
share one worker and one server start, a file's tests one worker, the files of a file group one
worker in collection order, and each worker runs torch on its share of the cores."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections import defaultdict

import pytest

from server.paths import ROOT

CONFTEST = """
    import os
    import pytest
    from tests.harness.xdist_workers import mark_worker_groups, share_the_cores

    def pytest_configure(config):
        share_the_cores(config)

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(items):
        mark_worker_groups(items)

    @pytest.fixture(scope="session")
    def server():
        import torch

        with open("server-starts", "a") as starts:
            starts.write(f"{os.environ['PYTEST_XDIST_WORKER']} {torch.get_num_threads()}\\n")

    @pytest.fixture(scope="session")
    def bench_scratch():
        return None
"""
SERVER_TESTS = """
    import time

    def test_one(server):
        time.sleep(0.2)

    def test_two(server):
        time.sleep(0.2)
"""
PLAIN_TESTS = """
    import time
    import pytest

    @pytest.mark.parametrize("case", range(4))
    def test_case(case):
        time.sleep(0.1)
"""
RESULT = re.compile(r"^\[(gw\d)\] .*PASSED (\S+?)::(\S+)@(\S+)\s*$", re.MULTILINE)


def workers_args(workers: int) -> list[str]:
    """The Makefile's ``WORKERS_ARGS`` with ``TEST_WORKERS=workers``."""
    line = re.search(r"^WORKERS_ARGS = (.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert line, "the Makefile sets no WORKERS_ARGS"
    return line[1].replace("$(TEST_WORKERS)", str(workers)).split()


def run_suite(tmp_path, files: dict[str, str], workers: int = 2) -> subprocess.CompletedProcess:
    for name, text in {"conftest.py": CONFTEST, **files}.items():
        (tmp_path / "tests" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "tests" / name).write_text(textwrap.dedent(text))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "tests", *workers_args(workers), "-v", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_session_servers_tests_share_one_worker_a_files_another_and_a_file_group_runs_in_order(tmp_path):
    suite = run_suite(
        tmp_path,
        {
            "integration/test_first_server_file.py": SERVER_TESTS,
            "integration/test_compile_cache.py": PLAIN_TESTS,
            "integration/test_second_server_file.py": SERVER_TESTS,
            "unit/test_engine_lora_slots.py": PLAIN_TESTS,
            "unit/test_plain.py": PLAIN_TESTS,
        },
    )
    assert suite.returncode == 0, suite.stdout + suite.stderr
    workers_by_group: dict[str, set[str]] = defaultdict(set)
    files_by_group: dict[str, list[str]] = defaultdict(list)
    for worker, path, _, group in RESULT.findall(suite.stdout):  # in the order they ended
        workers_by_group[group].add(worker)
        files_by_group[group].append(path.removeprefix("tests/").removesuffix(".py"))
    assert {group: len(files) for group, files in files_by_group.items()} == {
        "session-servers": 4,
        "compiled-lora-slots": 8,
        "unit/test_plain": 4,
    }, suite.stdout
    assert all(len(workers) == 1 for workers in workers_by_group.values()), dict(workers_by_group)
    assert files_by_group["compiled-lora-slots"] == 4 * ["integration/test_compile_cache"] + 4 * [
        "unit/test_engine_lora_slots"
    ]
    (start,) = (tmp_path / "server-starts").read_text().splitlines()  # once
    assert int(start.split()[1]) == max(1, len(os.sched_getaffinity(0)) // 2), "torch's threads in a worker"


def test_a_test_of_two_shared_groups_is_refused_naming_it(tmp_path):
    both = "def test_both(server, bench_scratch):\n    pass\n"
    suite = run_suite(tmp_path, {"unit/test_engine_lora_slots.py": both}, workers=0)
    assert suite.returncode == pytest.ExitCode.USAGE_ERROR
    assert (
        "test_engine_lora_slots.py::test_both is in the groups "
        "['benchmark-scratch', 'compiled-lora-slots', 'session-servers']"
    ) in suite.stderr
