"""The README's examples (``<!-- example: NAME -->`` before a fenced block), run as written: only the
loopback ports are the test server's, and ``runtime/key_file.json`` is that server's key file."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from server import TorchServe
from server.paths import ROOT

EXAMPLE = re.compile(r"<!-- example: (?P<name>[\w-]+) -->\n```(?P<language>\w+)\n(?P<code>.*?)```", re.DOTALL)
RUNNERS = {"bash": ["bash", "-euo", "pipefail", "-c"], "python": [sys.executable, "-c"]}


def readme_examples() -> dict[str, tuple[str, str]]:
    """Name -> (language, code) of every example marked ``<!-- example: NAME -->`` in the README."""
    return {
        match["name"]: (match["language"], match["code"])
        for match in EXAMPLE.finditer((ROOT / "README.md").read_text())
    }


def run_example(name: str, server: TorchServe, cwd: Path) -> subprocess.CompletedProcess:
    language, code = readme_examples()[name]
    code = code.replace("http://127.0.0.1:8080", server.addresses.inference).replace(
        "http://127.0.0.1:8081", server.addresses.management
    )
    result = subprocess.run(RUNNERS[language] + [code], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"README example {name!r} failed:\n{result.stdout}\n{result.stderr}"
    return result
