"""The scheduler steps that keep their arithmetic on the host (``handler.families.schedules``) equal
diffusers' own ``step`` bit for bit on the CPU, in the settings a model's scheduler config may bring
that the engine's parity tests (tests/unit/test_engine.py: the default configs) do not reach: UniPC
of every order, both solver types, predicting the sample or the noise, on noise and v-prediction;
LMS on each prediction type, from the first step and from an image's later one, with coefficients
integrated at a step's first use and kept for the schedule's next job."""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers import LMSDiscreteScheduler, UniPCMultistepScheduler

from handler.families.base import LmsCoefficients
from handler.families.schedules import lms_step, unipc_step

STEPS = 7


@pytest.mark.parametrize("solver_order", [1, 2, 3])
@pytest.mark.parametrize("solver_type", ["bh1", "bh2"])
@pytest.mark.parametrize("predict_x0", [True, False])
@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_unipc_step_equals_diffusers(solver_order, solver_type, predict_x0, prediction_type):
    config = dict(
        solver_order=solver_order, solver_type=solver_type, predict_x0=predict_x0, prediction_type=prediction_type
    )
    ours, theirs = UniPCMultistepScheduler(**config), UniPCMultistepScheduler(**config)
    for scheduler in (ours, theirs):
        scheduler.set_timesteps(STEPS)
        scheduler.set_begin_index(0)
    generator = torch.Generator().manual_seed(solver_order)
    sample = torch.randn(2, 4, 8, 8, generator=generator)
    ours_sample, theirs_sample = sample, sample.clone()
    orders = set()
    for step, timestep in enumerate(theirs.timesteps):
        output = torch.randn(2, 4, 8, 8, generator=generator)
        ours_sample = unipc_step(ours, output, timestep, ours_sample)
        theirs_sample = theirs.step(output, timestep, theirs_sample, return_dict=False)[0]
        # bit for bit; predicting the noise, the last step divides by its sigma of 0 as diffusers does
        torch.testing.assert_close(ours_sample, theirs_sample, rtol=0, atol=0, equal_nan=True, msg=f"step {step}")
        assert ours.this_order == theirs.this_order and ours.lower_order_nums == theirs.lower_order_nums
        orders.add(ours.this_order)
    assert max(orders) == solver_order  # its highest order's coefficients were solved for


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
@pytest.mark.parametrize("use_karras_sigmas", [False, True])
@pytest.mark.parametrize("begin", [0, 3])
def test_lms_step_equals_diffusers_and_a_schedules_next_job_integrates_nothing(
    prediction_type, use_karras_sigmas, begin, monkeypatch
):
    config = dict(prediction_type=prediction_type, use_karras_sigmas=use_karras_sigmas)
    template, theirs = LMSDiscreteScheduler(**config), LMSDiscreteScheduler(**config)
    for scheduler in (template, theirs):
        scheduler.set_timesteps(STEPS)
    template.lms_coefficients = LmsCoefficients(template)
    first, second = copy.deepcopy(template), copy.deepcopy(template)  # two jobs of the schedule
    for scheduler in (first, second, theirs):
        scheduler.set_begin_index(begin)
    generator = torch.Generator().manual_seed(begin)
    sample = torch.randn(2, 4, 8, 8, generator=generator)
    first_sample, second_sample, theirs_sample = sample, sample, sample.clone()
    for step, timestep in enumerate(theirs.timesteps[begin:]):
        output = torch.randn(2, 4, 8, 8, generator=generator)
        theirs_sample = theirs.step(output, timestep, theirs_sample, return_dict=False)[0]
        first_sample = lms_step(first, output, timestep, first_sample)  # integrates this step's coefficients
        with monkeypatch.context() as patched:  # the next job looks them up
            patched.setattr(LMSDiscreteScheduler, "get_lms_coefficient", None)
            second_sample = lms_step(second, output, timestep, second_sample)
        torch.testing.assert_close(first_sample, theirs_sample, rtol=0, atol=0, msg=f"step {step}")
        torch.testing.assert_close(second_sample, theirs_sample, rtol=0, atol=0, msg=f"step {step}")
    assert len(first.derivatives) == len(second.derivatives) == min(STEPS - begin, 4)
    assert template.lms_coefficients.integrated == STEPS - begin  # its steps' only


@pytest.mark.parametrize("steps", [2, 25, 998])
@pytest.mark.parametrize(
    "config",
    [{}, {"use_karras_sigmas": True}, {"beta_schedule": "scaled_linear", "timestep_spacing": "trailing"}],
    ids=["linear", "karras", "scaled-trailing"],
)
def test_lms_coefficients_over_host_sigmas_equal_diffusers_own_bit_for_bit(steps, config):
    """The coefficients integrated over a NumPy copy of the sigmas equal those ``get_lms_coefficient``
    integrates over the scheduler's tensors, at every order (the first 100 steps and the last)."""
    scheduler = LMSDiscreteScheduler(**config)
    scheduler.set_timesteps(steps)
    ours = LmsCoefficients(scheduler)
    for index in [*range(min(steps, 100)), steps - 1]:
        order = min(index + 1, 4)
        assert ours[index] == [scheduler.get_lms_coefficient(order, index, k) for k in range(order)], index
