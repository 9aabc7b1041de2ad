"""``make bench-compile-rows``'s summary and table (the measuring itself compiles, minutes a model)."""

from __future__ import annotations

from bench.compile_rows import JOBS, job_name, summary, table


def _run(family: str, setting: str, seconds: tuple[float, ...], graphs: tuple[int, ...]) -> dict:
    names = [job_name(*job) for job in JOBS]
    jobs = [{"job": name, "seconds": s, "graphs": g} for name, s, g in zip(names, seconds, graphs, strict=True)]
    return {"family": family, "setting": setting, "jobs": jobs}


def test_the_summary_takes_medians_per_model_and_setting_and_the_table_their_ratios():
    runs = [
        _run("sd1", "static", (28.0, 32.0, 10.0, 12.0), (1, 2, 5, 7)),
        _run("sd1", "marked", (38.0, 0.0, 12.0, 0.0), (1, 1, 3, 3)),
        _run("sd1", "static", (30.0, 34.0, 12.0, 14.0), (1, 2, 5, 7)),
        _run("sd1", "marked", (40.0, 0.2, 14.0, 0.2), (1, 1, 3, 3)),
        _run("sd1", "cudagraphs", (13.0, 0.0, 0.05, 0.05), (1, 1, 1, 1)),
        _run("sd3", "marked", (20.0, 0.0, 5.0, 0.0), (1, 1, 2, 2)),  # a model measured in one setting alone
    ]
    rows = summary(runs)
    assert [(row["family"], row["setting"], row["runs"]) for row in rows] == [
        ("sd1", "static", 2),
        ("sd1", "marked", 2),
        ("sd1", "cudagraphs", 1),
        ("sd3", "marked", 1),
    ]
    assert rows[0]["seconds"] == [29.0, 33.0, 11.0, 13.0] and rows[0]["total_s"] == 86.0
    assert rows[0]["graphs"] == [1, 2, 5, 7] and rows[1]["total_s"] == 52.2 and rows[1]["graphs"] == [1, 1, 3, 3]
    text = table(rows)
    assert "| 3 images (s) | 2 images (s) | 3 images, cached (s) | 2 images, cached (s) | all (s) |" in text
    assert "| sd1 | marked | 39.0 | 0.1 | 13.0 | 0.1 | 52.2 | 1, 1, 3, 3 | 0.61x marked / static |" in text
    assert "| sd1 | cudagraphs | 13.0 | 0.0 | 0.1 | 0.1 | 13.1 | 1, 1, 1, 1 | 0.25x cudagraphs / marked |" in text
    assert "| sd1 | static |" in text and "| sd3 | marked | 20.0 | 0.0 | 5.0 | 0.0 | 25.0 | 1, 1, 2, 2 | — |" in text
