"""Row costs (``handler.engine.costs``): a ControlNet row costs more than a plain one and a row at a
DeepCache cached step less, by the operations counted on fake tensors; the step-time profile's caps
and memory limits count them, so a ControlNet's out-of-memory does not shrink plain traffic's limit
by its row count."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from handler.adapters.controlnets import ControlSpec
from handler.config import StepCache
from handler.engine.costs import ATTENTION_FORMULAS, Cost, RowCosts
from handler.engine.scheduling import StepProfile, choose
from tests.harness.engine_runs import EVERY_STEP_SKIPPING, engine_with_adapters, picture, spec

SIDE = 64


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return engine_with_adapters("sd1", tmp_path_factory.mktemp("sd1"))


def test_a_controlnet_row_costs_more_and_a_cached_step_less(engine):
    (edges,) = engine.controlnets.acquire(["edges"], in_use=())
    control = (ControlSpec(edges, picture(SIDE, 3), 0.9),)
    plain, controlled, shallow, deeper = engine.start(
        [
            spec(side=SIDE, steps=4),
            spec(side=SIDE, steps=4, controls=control),
            spec(side=SIDE, steps=4, cache=StepCache(mode="deep", interval=3, branch=0)),
            spec(side=SIDE, steps=4, cache=StepCache(mode="deep", interval=3, branch=5)),
        ]
    )
    costs = RowCosts(engine)
    assert costs.of(controlled) == Cost.rows(controlled.rows), "a shape not counted yet costs its rows"
    costs.count(plain)
    assert costs.of(plain) == Cost.rows(plain.rows) == Cost.rows(2)
    controlled_cost = costs.of(controlled)
    assert 2 < controlled_cost.time == controlled_cost.memory < 4  # the tiny ControlNet: about half its UNet
    assert costs.at_start(controlled.spec, controlled.latent_shape) == controlled_cost.time
    assert costs.of(shallow) == costs.of(deeper) == Cost.rows(2), "a full step costs every block"
    engine.step([plain, controlled, shallow, deeper])  # their step 1 reuses the deep blocks
    assert 0 < costs.of(shallow).time < costs.of(deeper).time < 2
    assert costs.of(shallow).memory == costs.of(deeper).memory == 2, "its memory does not shrink"


def attention_settings() -> tuple[bool, ...]:
    """The process-wide switches of scaled_dot_product_attention's kernels."""
    backends = torch.backends.cuda
    return (
        backends.flash_sdp_enabled(),
        backends.mem_efficient_sdp_enabled(),
        backends.math_sdp_enabled(),
        backends.cudnn_sdp_enabled(),
    )


def test_counting_changes_no_attention_setting_another_thread_sees(engine):
    """On a GPU the encoder threads' safety checkers run attention while the stepping thread counts
    a new shape's operations: the count leaves the kernels' process-wide switches as they were."""
    (job,) = engine.start([spec(side=SIDE, steps=4)])
    during = []
    hook = engine.family.denoiser.register_forward_pre_hook(lambda *_: during.append(attention_settings()))
    try:
        RowCosts(engine).count(job)
    finally:
        hook.remove()
    assert during == [attention_settings()]


def test_the_fused_attention_kernel_counts_as_its_math_path():
    """The CPU's fused kernel (no formula in FlopCounterMode) counts the math path's matrix products."""

    def count(backend: SDPBackend) -> int:
        counter = FlopCounterMode(display=False, custom_mapping=ATTENTION_FORMULAS)
        with sdpa_kernel(backend), FakeTensorMode(), counter:
            query, key, value = torch.empty(2, 5, 64, 8), torch.empty(2, 5, 77, 8), torch.empty(2, 5, 77, 8)
            torch.nn.functional.scaled_dot_product_attention(query, key, value)
        return counter.get_total_flops()

    assert count(SDPBackend.FLASH_ATTENTION) == count(SDPBackend.MATH) == 2 * (2 * 2 * 5 * 64 * 77 * 8)


def test_a_first_block_row_and_an_sd3_row_cost_their_rows(tmp_path):
    engine = engine_with_adapters("sd3", tmp_path)
    (job,) = engine.start([spec(side=SIDE, steps=3, scheduler="flow_match_euler", cache=StepCache(mode="first_block"))])
    costs = RowCosts(engine)
    costs.count(job)
    engine.step([job])
    assert costs.of(job) == Cost.rows(job.rows)


def test_skip_layer_rows_cost_rows_at_their_steps_and_admission_counts_them(tmp_path):
    """A job's skip-layer rows cost a row each at the steps of its window; admission checks its
    largest forward, so once one ran out of memory alone, another like it is refused, a plain job
    of its guided rows is not."""
    engine = engine_with_adapters("sd3", tmp_path)
    skipping = spec(side=SIDE, steps=4, scheduler="flow_match_euler", skip_layer_guidance=EVERY_STEP_SKIPPING)
    plain = spec(side=SIDE, steps=4, scheduler="flow_match_euler")
    (job,) = engine.start([skipping])
    profile = StepProfile(engine, max_images=16)
    assert profile.cost(job) == Cost.rows(2) and profile.costs.at_start(skipping, job.latent_shape) == 3
    engine.step([job])
    assert profile.cost(job) == Cost.rows(3)
    profile.ran_out_of_memory(job.latent_shape, job.rows, alone=True, padding=0)
    assert not profile.fits_job(skipping) and profile.fits_job(plain)


def test_a_controlnets_out_of_memory_limits_by_its_cost_not_its_rows(engine):
    """One ControlNet job too large alone: another like it is refused, a plain job of as many rows is not."""
    (edges,) = engine.controlnets.acquire(["edges"], in_use=())
    controlled_spec = spec(side=SIDE, steps=4, images=2, controls=(ControlSpec(edges, picture(SIDE, 3), 0.9),))
    plain, controlled = engine.start([spec(side=SIDE, steps=4, images=2), controlled_spec])
    profile = StepProfile(engine, max_images=16)
    profile.costs.count(plain)
    shape = plain.latent_shape
    profile.ran_out_of_memory(shape, profile.cost(controlled).memory, alone=True, padding=0)
    assert not profile.fits_job(controlled_spec)
    assert profile.fits_job(plain.spec)
    assert profile.cap(shape) == pytest.approx(profile.cost(controlled).memory / 2)
    # a limit of 9 plain rows: 4 + 4 rows would fit, 4 + the ControlNet job's cost (about 6.3) do not
    waiting, slacks = {"plain": plain, "controlled": controlled}, {"plain": 0.0, "controlled": 1.0}
    assert choose(waiting, slacks, lambda _: Cost.rows(9)) == ["plain", "controlled"]
    assert choose(waiting, slacks, lambda _: Cost.rows(9), profile.cost) == ["plain"]
