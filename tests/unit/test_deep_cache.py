"""DeepCache per row (``handler.families.deep_cache``): a cached job alone equals the ``DeepCache``
package's helper on diffusers' pipeline; cached and uncached jobs, and jobs of other intervals and
branches, share the engine's forwards, each equal to itself alone, and the deep blocks run only on
the rows at a full step; the request's ``cache`` field and its refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bench.reference import Reference
from handler.api.bodies import form_text
from handler.api.policy import RequestPolicy
from handler.api.protocol import IncomingRequest
from handler.config import CacheSettings, FamilyRules, RequestDefaults, StepCache
from handler.families.deep_cache import Branch
from server.paths import TINY_MODEL_DIRS
from tests.harness.decoding import decoded, refusal
from tests.harness.engine_runs import (
    assert_each_alone_equals_reference,
    assert_same_images,
    expected,
    hole,
    picture,
    run,
    spec,
    tiny_engine,
)
from tests.harness.images import assert_same_image, decode_json_images, decode_png
from tests.harness.stand_ins import batch, make_service
from tests.harness.stand_ins import run as run_service

FAMILIES = ("sd1", "sd2", "sdxl")
SIDE = {"sd1": 64, "sd2": 96, "sdxl": 64}  # each tiny model's native size


def deep(interval: int = 3, branch: int = 0) -> StepCache:
    return StepCache(mode="deep", interval=interval, branch=branch)


@pytest.fixture(scope="module")
def engines():
    return {family: tiny_engine(family) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_cached_job_alone_equals_the_deepcache_helper_and_differs_from_no_cache(engines, family):
    reference = Reference(TINY_MODEL_DIRS[family])
    for cache in (deep(3, 0), deep(2, 1), deep(2, 5)):
        job = spec(images=2, side=SIDE[family], steps=7, cache=cache)
        (decoded,) = run(engines[family], [(0, job)])
        assert_same_images(decoded, expected(reference, job))
    (uncached,) = run(engines[family], [(0, spec(images=2, side=SIDE[family], steps=7))])
    assert uncached.images[0].tobytes() != decoded.images[0].tobytes(), "the cache changed nothing"


def test_image_to_image_and_inpainting_with_a_cache_equal_the_helper(engines):
    jobs = (
        spec(steps=8, image=picture(64), strength=0.7, cache=deep(3)),
        spec(steps=6, image=picture(64), mask=hole(64), strength=1.0, cache=deep(2)),
    )
    assert_each_alone_equals_reference(engines["sd1"], Reference(TINY_MODEL_DIRS["sd1"]), jobs)


def deep_rows(engine) -> list[int]:
    """Rows through the UNet's mid block per call: the deep blocks' rows."""
    rows: list[int] = []
    engine.family.denoiser.mid_block.resnets[0].register_forward_pre_hook(
        lambda module, args: rows.append(args[0].shape[0])
    )
    return rows


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_and_uncached_jobs_share_forwards_each_equal_to_itself_alone(engines, family):
    engine, side = engines[family], SIDE[family]
    plan = [
        (0, spec("a red circle", seed=1, side=side, steps=7, cache=deep(3))),
        (0, spec("a blue square", seed=2, side=side, steps=6)),
        (1, spec("a green triangle", seed=3, side=side, steps=6, images=2, cache=deep(2, 1), scheduler="euler")),
        (2, spec("a yellow star", seed=5, side=side, steps=5, guidance=1.0, cache=deep(3))),
    ]
    alone = [run(engine, [(0, job)])[0] for _, job in plan]
    together = run(engine, plan)
    for mine, reference in zip(together, alone, strict=True):
        assert_same_images(mine, reference)


def test_the_deep_blocks_run_only_on_the_rows_at_a_full_step_in_the_steps_one_forward(engines):
    engine = engines["sd1"]
    rows = deep_rows(engine)
    shallow: list[int] = []
    engine.family.denoiser.conv_in.register_forward_pre_hook(lambda module, args: shallow.append(args[0].shape[0]))
    try:
        run(engine, [(0, spec(seed=1, steps=4, cache=deep(2))), (0, spec(seed=2, steps=4))])
    finally:
        engine.family.denoiser.mid_block.resnets[0]._forward_pre_hooks.clear()
        engine.family.denoiser.conv_in._forward_pre_hooks.clear()
    # 2 rows each (guidance): both at steps 0 and 2, the uncached one alone at steps 1 and 3
    assert rows == [4, 2, 4, 2]
    assert shallow == [4, 4, 4, 4], "the shallow layers ran in more than one forward a step"


@pytest.mark.parametrize("branch", [0, 2, 5])
def test_a_cached_job_keeps_one_hidden_state_of_its_own_rows(engines, branch):
    """Of the kept outputs, only the one a cached step's running layers read holds values (the
    job's rows' own copy); the others are shapes. The job holds them until it is done denoising."""
    engine = engines["sd1"]
    (job,) = engine.start([spec(steps=4, cache=deep(3, branch))])
    engine.step([job])
    assert job.cache is not None and job.cache.outputs
    held = {key: output for key, output in job.cache.outputs.items() if _tensors(output)}
    assert list(held) == [job.cache.branch.reused(engine.family.denoiser)]
    (hidden,) = _tensors(next(iter(held.values())))
    assert hidden.shape[0] == job.rows and hidden._base is None  # a copy, not a view of the batch's output
    assert engine.deep_cache is not None and engine.deep_cache._pass is None
    while not job.done:
        engine.step([job])
    assert job.cache.outputs == {} and job.cached_steps == 2, "a job done denoising still keeps its outputs"


def _tensors(output):
    if isinstance(output, torch.Tensor):
        return [output]
    return [tensor for part in output for tensor in _tensors(part)] if isinstance(output, tuple) else []


@pytest.mark.parametrize("family", FAMILIES)
def test_what_a_cached_job_keeps_is_known_before_it_starts(engines, family):
    """``kept_bytes``, what admission counts, equals the bytes of the hidden state a job keeps, for
    every branch, at a size of odd latents (the downsamplers round up)."""
    engine = engines[family]
    for branch in range(3 * len(engine.family.denoiser.down_blocks)):
        job_spec = spec(images=2, side=SIDE[family] + 8, steps=4, cache=deep(3, branch))
        (job,) = engine.start([job_spec])
        engine.step([job])
        (hidden,) = [tensor for output in job.cache.outputs.values() for tensor in _tensors(output)]
        assert engine.kept_bytes(job_spec) == hidden.nbytes, branch


def test_the_caches_in_flight_are_bounded_by_max_kept_mib(engines):
    """Two cached requests of 64x64 where one fits the bound: the second is a 503 to retry, an
    uncached one beside them is served, a cached one over the bound alone is a 400 naming ``cache``;
    once the first finished, a cached request is served again."""
    engine = engines["sd1"]
    one = engine.kept_bytes(spec(side=64, steps=3, cache=deep()))
    service = make_service(engine, streaming=False, cache=CacheSettings(max_kept_mib=1.5 * one / 2**20))
    cached = {"prompt": "p", "seed": 1, "num_inference_steps": 3, "cache": {"mode": "deep", "interval": 3}}
    responses = batch(
        service,
        IncomingRequest(cached, "application/json"),
        IncomingRequest({**cached, "seed": 2}, "application/json"),
        IncomingRequest({**cached, "cache": {"mode": "off"}}, "application/json"),
        IncomingRequest({**cached, "num_images_per_prompt": 2}, "application/json"),
    )
    assert [response.status for response in responses] == [200, 503, 200, 400]
    assert "Retry-After" in responses[1].headers and b"max_kept_mib" in responses[1].body
    (error,) = json.loads(responses[3].body)["errors"]
    assert error["field"] == "cache" and error["rule"] == "cache_memory"
    (again,) = batch(service, IncomingRequest({**cached, "seed": 2}, "application/json"))
    assert again.status == 200


def test_a_streaming_cached_request_gets_previews_and_the_image_it_gets_without_a_stream(engines):
    """Continuous batching on the tiny SD 1.x engine: a cached request streamed with previews,
    joined mid-flight by an uncached one, ends with the image the same request gets unstreamed."""
    service = make_service(engines["sd1"])
    cached = {"prompt": "p", "seed": 4, "num_inference_steps": 6, "cache": {"mode": "deep", "interval": 2}}
    streamed = IncomingRequest({**cached, "stream": True, "partial_images": 2}, "application/json")
    beside = IncomingRequest({"prompt": "q", "seed": 5, "num_inference_steps": 3}, "application/json")
    parts = run_service(service, {0: {"s": streamed}, 1: {"u": beside}})
    events = [json.loads(line) for part in parts["s"] for line in part.body.decode().splitlines()]
    assert [event["step"] for event in events[:-1] if "images" in event] == [2, 4]
    (plain,) = batch(service, IncomingRequest(cached, "application/json"))
    (image,) = decode_json_images(events[-1])
    assert_same_image(image, decode_png(plain.body))
    assert parts["u"][-1].status == 200


def test_branches_skip_as_the_helper_does():
    """``DeepCacheSDHelper.is_skip_step`` for branch 0 and 4 (block 1, layer 1), and what is kept."""
    shallow, middle = Branch.of(0), Branch.of(4)
    assert middle == Branch(1, 1)
    assert shallow.skips(("down", "resnet", 0, 0)) and not shallow.skips(("up", "block", 0, 0))
    assert shallow.skips(("up", "resnet", 0, 1)) and not shallow.skips(("up", "resnet", 0, 0))
    assert shallow.skips(("mid", "mid_block", 0, 0)) and middle.skips(("mid", "mid_block", 0, 0))
    assert not middle.skips(("down", "resnet", 1, 0)) and middle.skips(("down", "resnet", 1, 1))
    assert not middle.skips(("up", "resnet", 1, 1)) and middle.skips(("up", "resnet", 1, 2))
    # a skipped block keeps its output, not its layers'; a running block's skipped layers keep theirs
    assert shallow.keeps(("down", "block", 0, 0)) and not shallow.keeps(("down", "resnet", 0, 0))
    assert shallow.keeps(("up", "resnet", 0, 1)) and not shallow.keeps(("up", "resnet", 0, 0))


# The request's cache field.

UNET = FamilyRules(cache_branches=6)
POLICY = RequestPolicy(defaults=RequestDefaults(width=64, height=64), rules=UNET)


def test_a_request_without_a_cache_gets_the_servers_default_where_the_model_serves_it():
    assert decoded(POLICY).cache == StepCache()
    cached = RequestPolicy(rules=UNET, cache=CacheSettings(default=deep(4)))
    assert decoded(cached).cache == deep(4)
    assert decoded(cached, cache={"mode": "off"}).cache.mode == "off"
    transformer = RequestPolicy(rules=FamilyRules(family="SD 3"), cache=CacheSettings(default=deep(4)))
    assert decoded(transformer).cache == StepCache()
    assert decoded(cached).parameters()["cache"] == {"mode": "deep", "interval": 4, "branch": 0}


def test_a_cache_outside_the_limits_or_not_served_is_a_400_naming_it():
    assert refusal(POLICY, cache={"mode": "deep", "interval": 11}).field == "cache"
    assert "cache.max_interval" in refusal(POLICY, cache={"mode": "deep", "interval": 11}).message
    assert "0..5" in refusal(POLICY, cache={"mode": "deep", "branch": 6}).message
    assert refusal(POLICY, cache={"mode": "deep", "interval": 0}).field == "cache.interval"
    assert refusal(POLICY, cache={"mode": "cached"}).field == "cache.mode"
    assert "serves none" in refusal(RequestPolicy(), cache={"mode": "first_block"}).message
    assert refusal(POLICY, cache={"mode": "deep", "depth": 2}).field == "cache.depth"
    assert refusal(POLICY, cache="deep").field == "cache"
    sd3 = RequestPolicy(rules=FamilyRules(family="SD 3"))
    assert "SD 3 model serves none" in refusal(sd3, cache={"mode": "deep"}).message


def test_a_forms_cache_is_json_text():
    fields = form_text({"prompt": b"p", "cache": json.dumps({"mode": "deep", "interval": 2}).encode()})
    assert decoded(POLICY, **fields).cache == deep(2)
    assert refusal(POLICY, **form_text({"prompt": b"p", "cache": b"{deep"})).field == "cache"


def test_bench_cache_times_every_workload_against_no_cache_and_plots_it(tmp_path):
    from bench import cache as bench_cache

    result = bench_cache.measure(bench_cache.Model("tiny", TINY_MODEL_DIRS["sd1"], 32, 3), steps=3, repeats=1)
    assert result["graphs_warm_up_round"] is None and "graphs compiled" not in bench_cache.table([result])
    compiled = {**result, "model": "tiny compiled", "graphs_warm_up_round": 5, "graphs_after_it": 0}  # --compile's
    assert "paired rounds; graphs compiled: 5 in the warm-up round, 0 after it)" in bench_cache.table([compiled])
    rows = {row["workload"]: row for row in result["rows"]}
    assert list(rows) == list(bench_cache.WORKLOADS)
    assert rows[bench_cache.NONE]["ratio"] == 1.0 and rows[bench_cache.NONE]["psnr_db"] is None
    assert all(row["images_per_s"] > 0 and row["ratio"] > 0 for row in rows.values())
    assert all(rows[name]["psnr_db"] is not None for name in rows if name != bench_cache.NONE), "no image moved"
    assert rows[bench_cache.NONE]["cached_share"] is None and 0 < rows["half cached"]["cached_share"] < 1
    tiny_sd35 = bench_cache.MODELS["sd35-tiny"]
    first_block = bench_cache.measure(tiny_sd35, steps=4, repeats=1)
    shares = {row["workload"]: row["cached_share"] for row in first_block["rows"]}
    assert list(shares) == list(bench_cache.FIRST_BLOCK_WORKLOADS)
    assert shares["all 8 at threshold 0.3"] > 0, "no step skipped"
    bench_cache.plot([result, first_block], tmp_path / "cache.png")
    assert (tmp_path / "cache.png").stat().st_size > 0
    assert "| all 8 at interval 3 |" in bench_cache.table([result])
    assert "| all 8 at threshold 0.3 |" in bench_cache.table([first_block])
    settings = (("no cache", 0), ("interval 2", 9))
    pictures = {name: [np.full((8, 8, 3), level, np.uint8)] * 48 for name, level in settings}
    bench_cache.grid(pictures, tmp_path / "grid.png")
    assert (tmp_path / "grid.png").stat().st_size > 0
    rows = [{"setting": "interval 2", "colour": 1.0, "shape": 0.875, "psnr_db": 29.04}]
    assert "| interval 2 | 100% | 88% | 29.0 |" in bench_cache.quality_table({"images": 48, "steps": 25, "rows": rows})
