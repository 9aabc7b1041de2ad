"""`make bench-controlnet` on a tiny model: every case is timed and takes the forwards its design says
(shared: one UNet forward per step and each ControlNet once; grouped: a UNet forward per ControlNet
set), and the report says so."""

from __future__ import annotations

from bench.controlnets import ALONE, PLAIN, Model, measure, table
from server.paths import TINY_MODEL_DIRS


def test_the_shared_forward_takes_one_unet_forward_and_each_controlnet_once():
    result = measure(Model("tiny", TINY_MODEL_DIRS["sd1"], 32, None), steps=1, repeats=1)
    forwards = {(row["workload"], row["design"]): tuple(row["forwards"]) for row in result["rows"]}
    assert forwards == {
        (PLAIN, "shared"): (1, 0),
        ("1 request, none", "shared"): (1, 0),
        (ALONE, "shared"): (1, 1),
        ("one ControlNet, all 8", "shared"): (1, 1),
        ("one ControlNet, all 8", "grouped"): (1, 1),
        ("4 with one, 4 without", "shared"): (1, 1),
        ("4 with one, 4 without", "grouped"): (2, 1),
        ("4 with one, 4 with another", "shared"): (1, 2),
        ("4 with one, 4 with another", "grouped"): (2, 2),
    }
    assert all(row["median_s"] > 0 and row["ratio"] > 0 for row in result["rows"])
    assert "| 4 with one, 4 with another |" in table([result])
