"""``make test``'s two pytest-xdist workers, as tests.harness.xdist_workers sets them up: run on a small
suite of its own, with the project's pinned pytest and pytest-xdist, the tests of a session server
share one worker and one server start, a file's tests one worker, and each worker runs torch on its
share of the cores."""

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


def run_suite(tmp_path, files: dict[str, str], workers: int = 2) -> subprocess.CompletedProcess:
    (tmp_path / "tests").mkdir()
    for name, text in {"conftest.py": CONFTEST, **files}.items():
        (tmp_path / "tests" / name).write_text(textwrap.dedent(text))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "tests",
            f"-n{workers}",
            "--dist",
            "loadgroup",
            "-v",
            "-p",
            "no:cacheprovider",
        ],
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_session_servers_tests_share_one_worker_and_a_files_tests_another(tmp_path):
    suite = run_suite(
        tmp_path,
        {
            "test_first_server_file.py": SERVER_TESTS,
            "test_second_server_file.py": SERVER_TESTS,
            "test_plain_a.py": PLAIN_TESTS,
            "test_plain_b.py": PLAIN_TESTS,
        },
    )
    assert suite.returncode == 0, suite.stdout + suite.stderr
    workers_by_group: dict[str, set[str]] = defaultdict(set)
    tests_by_group: dict[str, int] = defaultdict(int)
    for worker, path, _, group in RESULT.findall(suite.stdout):
        workers_by_group[group].add(worker)
        tests_by_group[group] += 1
        assert group == ("session-servers" if "server" in path else path.removeprefix("tests/").removesuffix(".py"))
    assert dict(tests_by_group) == {"session-servers": 4, "test_plain_a": 4, "test_plain_b": 4}, suite.stdout
    assert all(len(workers) == 1 for workers in workers_by_group.values()), dict(workers_by_group)
    (start,) = (tmp_path / "server-starts").read_text().splitlines()  # once
    assert int(start.split()[1]) == max(1, len(os.sched_getaffinity(0)) // 2), "torch's threads in a worker"


def test_a_test_of_two_shared_groups_is_refused_naming_it(tmp_path):
    both = "def test_both(server, bench_scratch):\n    pass\n"
    suite = run_suite(tmp_path, {"test_both.py": both}, workers=0)
    assert suite.returncode == pytest.ExitCode.USAGE_ERROR
    assert "test_both.py::test_both uses the fixtures of ['benchmark-scratch', 'session-servers']" in suite.stderr
