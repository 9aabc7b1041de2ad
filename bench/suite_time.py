"""The test suite's time per test file, before and after a change, from two runs' JUnit reports
(``make test PYTEST_ARGS=--junitxml=FILE``): a Markdown table of the files that took longest, and a
PNG of them side by side. The files' seconds add up to more than the run's wall-clock time where
``make test``'s xdist workers ran files side by side: the table gives both.

    python -m bench.suite_time before.xml after.xml --output docs/img/suite-time.png
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def seconds_per_file(report: Path) -> dict[str, float]:
    """Each test file's seconds (setup, call and teardown, as pytest reports a test case's time)."""
    files: collections.Counter[str] = collections.Counter()
    for case in ET.parse(report).iter("testcase"):
        modules = [part for part in case.get("classname", "").split(".") if not part[:1].isupper()]
        files["/".join(modules).removeprefix("tests/") + ".py"] += float(case.get("time", 0))
    return dict(files)


def run_seconds(report: Path) -> float:
    """The run's wall-clock seconds (its test suite's time)."""
    return sum(float(suite.get("time", 0)) for suite in ET.parse(report).iter("testsuite"))


def table(before: dict[str, float], after: dict[str, float], top: int, runs: tuple[float, float] | None = None) -> str:
    """The ``top`` files that took longest in either run, then the rest and the whole, and the runs'
    wall-clock seconds where given."""
    names = sorted(set(before) | set(after), key=lambda name: -max(before.get(name, 0), after.get(name, 0)))
    cell = lambda value: "—" if value is None else f"{value:.0f}"  # noqa: E731
    lines = ["| test file | before (s) | after (s) |", "| --- | --- | --- |"]
    lines += [f"| `{name}` | {cell(before.get(name))} | {cell(after.get(name))} |" for name in names[:top]]
    rest = names[top:]
    lines.append(
        f"| the other {len(rest)} files | {sum(before.get(n, 0) for n in rest):.0f} | "
        f"{sum(after.get(n, 0) for n in rest):.0f} |"
    )
    lines.append(f"| **all** | **{sum(before.values()):.0f}** | **{sum(after.values()):.0f}** |")
    if runs:
        lines.append(f"| **the run, wall clock** | **{runs[0]:.0f}** | **{runs[1]:.0f}** |")
    return "\n".join(lines)


def plot(before: dict[str, float], after: dict[str, float], top: int, path: Path) -> None:
    names = sorted(set(before) | set(after), key=lambda name: -max(before.get(name, 0), after.get(name, 0)))[:top]
    figure, axis = plt.subplots(figsize=(10, 0.35 * top + 1.5))
    positions = range(len(names))
    axis.barh([p + 0.2 for p in positions], [before.get(n, 0) for n in names], 0.4, label="before", color="tab:gray")
    axis.barh([p - 0.2 for p in positions], [after.get(n, 0) for n in names], 0.4, label="after", color="tab:blue")
    axis.set_yticks(list(positions), names)
    axis.invert_yaxis()
    axis.set_xlabel("seconds")
    total = f"all files {sum(before.values()) / 60:.1f} min before, {sum(after.values()) / 60:.1f} after"
    axis.set_title(f"make test, seconds per test file ({total})")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--top", type=int, default=20, help="files listed by name")
    parser.add_argument("--output", type=Path, help="where the PNG goes (none: no plot)")
    args = parser.parse_args()
    before, after = seconds_per_file(args.before), seconds_per_file(args.after)
    print(table(before, after, args.top, (run_seconds(args.before), run_seconds(args.after))))
    if args.output:
        plot(before, after, args.top, args.output)


if __name__ == "__main__":
    main()
