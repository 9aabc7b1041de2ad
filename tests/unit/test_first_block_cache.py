"""First-block caching per row for SD 3.x (``handler.families.first_block_cache``): a cached job alone
equals diffusers' First Block Cache on its pipeline; cached and uncached jobs, and jobs of other
thresholds and LoRA sets, share the step's forward, each equal to itself alone, and the other blocks
run only on the rows that compute; a step reads one vector on the host; the request's ``cache``."""

from __future__ import annotations

import pytest
import torch

from bench.reference import Reference
from handler.api.policy import RequestPolicy
from handler.config import CacheSettings, FamilyRules, RequestDefaults, StepCache
from server.paths import TINY_MODEL_DIRS
from tests.harness.decoding import decoded, refusal
from tests.harness.engine_runs import (
    assert_each_alone_equals_reference,
    assert_same_images,
    engine_with_adapters,
    expected,
    hole,
    jobs_of_every_kind,
    picture,
    run,
    spec,
    tiny_engine,
)
from tests.harness.host_reads import HostReads, ValueReads

FAMILIES = ("sd3", "sd35")
FLOW = "flow_match_euler"


def first_block(threshold: float) -> StepCache:
    return StepCache(mode="first_block", threshold=threshold)


def job(prompt: str = "a red circle", seed: int = 0, **fields):
    return spec(prompt, seed, side=fields.pop("side", 64), scheduler=FLOW, **fields)


@pytest.fixture(scope="module")
def engines():
    return {family: tiny_engine(family) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_cached_job_alone_equals_diffusers_first_block_cache_and_threshold_0_equals_none(engines, family):
    engine, reference = engines[family], Reference(TINY_MODEL_DIRS[family])
    (uncached,) = run(engine, [(0, job(images=2, steps=8))])
    for threshold in (0.3, 0.5):
        (decoded,) = run(engine, [(0, job(images=2, steps=8, cache=first_block(threshold)))])
        assert_same_images(decoded, expected(reference, job(images=2, steps=8, cache=first_block(threshold))))
    assert uncached.images[0].tobytes() != decoded.images[0].tobytes(), "the cache changed nothing"
    (none_skipped,) = run(engine, [(0, job(images=2, steps=8, cache=first_block(0.0)))])
    assert [image.tobytes() for image in none_skipped.images] == [image.tobytes() for image in uncached.images]


@pytest.mark.parametrize("family", FAMILIES)
def test_image_to_image_and_inpainting_with_a_cache_equal_diffusers(engines, family):
    jobs = (
        job(steps=8, image=picture(64), strength=0.7, cache=first_block(0.5)),
        job(steps=6, image=picture(64), mask=hole(64), strength=0.9, cache=first_block(0.5)),
    )
    assert_each_alone_equals_reference(engines[family], Reference(TINY_MODEL_DIRS[family]), jobs)


def other_rows(engine) -> list[int]:
    """Rows through the second transformer block's first layer per call: the rows that compute (a
    block that passes its inputs through runs no layer)."""
    rows: list[int] = []
    engine.family.denoiser.transformer_blocks[1].norm1.register_forward_pre_hook(
        lambda module, args: rows.append(args[0].shape[0])
    )
    return rows


def test_cached_and_uncached_jobs_share_forwards_each_equal_to_itself_alone(tmp_path):
    engine = engine_with_adapters("sd3", tmp_path)
    lora = engine.loras.acquire([("attention", 0.8)], in_use=())
    plan = [
        (0, job("a red circle", 1, steps=8, cache=first_block(0.5))),
        (0, job("a blue square", 2, steps=6, adapters=lora)),
        (1, job("a green triangle", 3, steps=7, images=2, adapters=lora, cache=first_block(0.3))),
        (2, job("a yellow star", 5, steps=5, guidance=1.0, cache=first_block(0.5))),
    ]
    alone = [run(engine, [(0, one)])[0] for _, one in plan]
    together = run(engine, plan)
    for mine, reference in zip(together, alone, strict=True):
        assert_same_images(mine, reference)


def test_the_other_blocks_run_only_on_the_rows_that_compute(engines):
    engine = engines["sd3"]
    rows = other_rows(engine)
    try:
        jobs = engine.start([job(seed=1, steps=4, cache=first_block(0.5)), job(seed=2, steps=4)])
        while not all(one.done for one in jobs):
            engine.step([one for one in jobs if not one.done])
    finally:
        engine.family.denoiser.transformer_blocks[1].norm1._forward_pre_hooks.clear()
    # 2 rows each (guidance): both at step 0, then the cached job skips (every step, at 0.5)
    assert rows == [4, 2, 2, 2]
    assert [one.cached_steps for one in jobs] == [3, 0]


def test_a_cached_job_keeps_its_own_rows_residuals_as_admission_counts_them(engines):
    engine = engines["sd3"]
    cached_spec = job(images=2, steps=4, cache=first_block(0.5))
    (cached,) = engine.start([cached_spec])
    engine.step([cached])
    cache = cached.cache
    assert cache is not None and cache.head is not None and cache.tail is not None
    assert cache.head.shape[0] == cache.tail.shape[0] == cached.rows == 4
    assert cache.head._base is None  # a copy, not a view of the batch's residual
    assert engine.kept_bytes(cached_spec) == cache.head.nbytes + cache.tail.nbytes
    while not cached.done:
        engine.step([cached])
    assert cache.head is None and cache.tail is None, "a job done denoising still keeps its residuals"
    assert cached.cached_steps == 3


def test_a_step_with_cached_rows_reads_their_changes_once(tmp_path):
    """The decision is the one host read of a step with first-block rows (none at the first step,
    with nothing to compare); the other jobs of every kind read nothing."""
    engine = engine_with_adapters("sd3", tmp_path)
    jobs = jobs_of_every_kind(engine, FLOW, first_block=True, skip_layers=True)
    assert jobs[-1].cache is not None
    with HostReads() as reads, ValueReads() as values:
        engine.step(jobs)
    assert reads.reads == values.reads == []
    for _ in range(3):
        with HostReads() as reads, ValueReads() as values:
            engine.step(jobs)
        assert reads.reads == [] and values.reads == ["tolist"]
    assert jobs[-1].cached_steps == 3


def test_a_lora_sub_batch_restores_the_forwards_rows(tmp_path):
    """The sub-batch's LoRA rows are nested in the forward's: after it, the forward's are back."""
    engine = engine_with_adapters("sd3", tmp_path)
    lora = engine.loras.acquire([("attention", 0.8)], in_use=())
    with engine.loras.rows([(lora, 2), ((), 2)], torch.device("cpu")):
        outer = engine.loras.row_loras._plan
        with engine.loras.rows([((), 2)], torch.device("cpu")):
            assert engine.loras.row_loras._plan is not outer
        assert engine.loras.row_loras._plan is outer


# The request's cache field.

SD3 = FamilyRules(family="SD 3.x", first_block_cache=True)
POLICY = RequestPolicy(defaults=RequestDefaults(width=64, height=64), rules=SD3)


def test_a_first_block_cache_is_taken_and_reported_with_its_threshold():
    assert decoded(POLICY, cache={"mode": "first_block", "threshold": 0.2}).cache == first_block(0.2)
    assert decoded(POLICY, cache={"mode": "first_block"}).parameters()["cache"] == {
        "mode": "first_block",
        "threshold": 0.1,
    }
    cached = RequestPolicy(rules=SD3, cache=CacheSettings(default=first_block(0.25)))
    assert decoded(cached).cache == first_block(0.25)
    unet = RequestPolicy(rules=FamilyRules(cache_branches=6), cache=CacheSettings(default=first_block(0.25)))
    assert decoded(unet).cache == StepCache()


def test_a_first_block_cache_outside_the_limits_or_not_served_is_a_400_naming_it():
    above = refusal(POLICY, cache={"mode": "first_block", "threshold": 0.6})
    assert above.field == "cache" and "cache.max_threshold" in above.message
    assert refusal(POLICY, cache={"mode": "first_block", "threshold": -0.1}).field == "cache.threshold"
    assert refusal(POLICY, cache={"mode": "first_block", "threshold": "nan"}).field == "cache.threshold"
    deep = refusal(POLICY, cache={"mode": "deep"})
    assert deep.field == "cache" and "serves first_block" in deep.message
    unet = RequestPolicy(rules=FamilyRules(cache_branches=6))
    served = refusal(unet, cache={"mode": "first_block", "threshold": 0.1})
    assert served.field == "cache" and "serves deep" in served.message


def test_a_default_threshold_above_the_limit_is_a_configuration_error():
    with pytest.raises(ValueError, match="cache.max_threshold"):
        CacheSettings(default=first_block(0.8))
