"""The continuous-batching benchmark's pure parts: the request mix and the verdict table."""

from bench.continuous import SIDES, STEP_MIX, Point, markdown, request_bodies


def test_request_bodies_are_reproducible_and_draw_from_the_mix():
    bodies = request_bodies(200, SIDES["mixed resolution"], seed=7)
    assert bodies == request_bodies(200, SIDES["mixed resolution"], seed=7)
    assert {body["num_inference_steps"] for body in bodies} == set(STEP_MIX)
    assert {body["width"] for body in bodies} == {64, 128} and all(body["width"] == body["height"] for body in bodies)
    assert [body["seed"] for body in bodies] == list(range(200))


def test_markdown_states_both_capacities_and_the_ratios_per_load():
    def point(engine, p95, images):
        return Point(engine, "uniform", 0.7, 3.0, 80, 0, 0.5, p95, 3.0, images)

    table = markdown([point("dynamic", 2.0, 3.0), point("continuous", 1.0, 3.3)], {"dynamic": 4.0, "continuous": 5.0})
    assert "continuous / dynamic = 1.25x" in table
    assert "| uniform | 70% | 2.00x | 1.10x |" in table
