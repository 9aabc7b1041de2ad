"""``make bench-compile-rows``'s summary and table (the measuring itself compiles, minutes a model)."""

from __future__ import annotations

from bench.compile_rows import summary, table


def _run(family: str, setting: str, seconds: tuple[float, float], graphs: tuple[int, int]) -> dict:
    jobs = [{"images": images, "seconds": s, "graphs": g} for images, s, g in zip((3, 2), seconds, graphs, strict=True)]
    return {"family": family, "setting": setting, "jobs": jobs}


def test_the_summary_takes_medians_per_model_and_setting_and_the_table_their_ratio():
    runs = [
        _run("sd1", "static", (28.0, 32.0), (1, 2)),
        _run("sd1", "marked", (38.0, 0.0), (1, 1)),
        _run("sd1", "static", (30.0, 34.0), (1, 2)),
        _run("sd1", "marked", (40.0, 0.2), (1, 1)),
    ]
    rows = summary(runs)
    assert [(row["setting"], row["runs"]) for row in rows] == [("static", 2), ("marked", 2)]
    assert rows[0]["seconds"] == [29.0, 33.0] and rows[0]["total_s"] == 62.0 and rows[0]["graphs"] == [1, 2]
    assert rows[1]["total_s"] == 39.1 and rows[1]["graphs"] == [1, 1]
    text = table(rows)
    assert "| sd1 | marked | 39.0 | 0.1 | 39.1 | 1, 1 | 0.63x |" in text and "| sd1 | static |" in text
