"""Scheduler steps that read no tensor value on the host, so that on a GPU nothing in a denoising
step waits for the device.

diffusers' schedulers (0.42.1) read values inside ``step`` in four ways, each a wait for the device
where the value lives there (diffusers #9485, #9475):

- DDIM and PNDM index their CPU ``alphas_cumprod`` with the timestep and compare it with 0: six
  reads a step for DDIM, three for PNDM, when the timestep is the schedule's device tensor. Here
  they take it as a host number, from the CPU copy of the schedule a job keeps (``Family.scheduler``);
  their arithmetic is the same.
- Euler, Euler ancestral, DPM++ and flow matching look their first step up by timestep value
  (``index_for_timestep``: ``nonzero`` and ``item``) unless a begin index is set. Every job sets one
  (``set_begin_index(0)``, or the first step of an image's schedule), as SDXL's pipeline does;
  no schedule offered here repeats a timestep, so it is the same step.
- Euler compares its sigma with ``s_tmin``/``s_tmax`` even without churn. ``euler_step`` is its
  arithmetic without churn (the server passes none), so without the comparison.
- Euler ancestral, DDIM with an ``eta`` above 0 and DPM++'s SDE algorithm (``dpmpp_2m_sde_karras``)
  draw their noise on the CPU at every step and copy it to the device, which blocks.
  ``euler_ancestral_step`` is Euler ancestral's arithmetic with the noise drawn the same way and
  copied from pinned memory without blocking (``drawn_noise``); DDIM and DPM++ are given that noise
  as their ``variance_noise``.

A job from an image is noised to its first timestep (``add_noise``, flow matching's
``scale_noise``), and an inpainting job puts the image back at the next noise level after each
step. The schedulers that step by index copy their sigmas to the device at every call and index
them with a list (a blocking copy of the index); DDIM and PNDM copy their table there at their
first call (inpainting at strength 1: after its first step). ``noise_table`` makes that copy once,
queued while the job starts, and ``noised`` noises from it: by index, or DDIM's and PNDM's
``add_noise`` with the copy where their first call puts the table.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
)

from handler.families.base import Scheduler, steps_by_index
from handler.families.transfer import to_device

SDE_ALGORITHMS = ("sde-dpmsolver", "sde-dpmsolver++")  # DPMSolverMultistepScheduler's that draw noise


def timestep_argument(scheduler: Scheduler, timestep: torch.Tensor, host_timestep: float) -> torch.Tensor | int:
    """What ``scheduler.step`` takes as the timestep without reading it: schedulers with a begin
    index step by index and leave the device tensor unread; the others (DDIM, PNDM) get the host
    number."""
    return timestep if steps_by_index(scheduler) else int(host_timestep)


def step(
    scheduler: Scheduler,
    model_output: torch.Tensor,
    timestep: torch.Tensor,
    host_timestep: float,
    sample: torch.Tensor,
    step_kwargs: dict[str, Any],
) -> torch.Tensor:
    """One ``scheduler.step`` (the next latents) that reads no tensor value on the host."""
    if type(scheduler) is EulerDiscreteScheduler:
        return euler_step(scheduler, model_output, timestep, sample)
    if type(scheduler) is EulerAncestralDiscreteScheduler:
        return euler_ancestral_step(scheduler, model_output, timestep, sample, step_kwargs["generator"])
    noise_dtype = variance_noise_dtype(scheduler, model_output, step_kwargs)
    if noise_dtype is not None:  # its noise drawn as its step draws it
        noise = drawn_noise(model_output, step_kwargs["generator"], noise_dtype)
        step_kwargs = {**step_kwargs, "generator": None, "variance_noise": noise}
    argument = timestep_argument(scheduler, timestep, host_timestep)
    return scheduler.step(model_output, argument, sample, **step_kwargs, return_dict=False)[0]


def variance_noise_dtype(
    scheduler: Scheduler, model_output: torch.Tensor, step_kwargs: dict[str, Any]
) -> torch.dtype | None:
    """The dtype ``scheduler.step`` draws fresh noise in at every step (None: it draws none): DDIM's
    with an ``eta`` above 0 in the model's, DPM++'s SDE algorithms' in float32."""
    if type(scheduler) is DDIMScheduler and step_kwargs["eta"] > 0:
        return model_output.dtype
    if type(scheduler) is DPMSolverMultistepScheduler and scheduler.config.algorithm_type in SDE_ALGORITHMS:
        return torch.float32
    return None


def _step_index(scheduler: Any, timestep: torch.Tensor) -> int:
    if scheduler.step_index is None:
        scheduler._init_step_index(timestep)  # from the begin index every job sets: no lookup
    return scheduler.step_index


def _original_sample(
    scheduler: Any, model_output: torch.Tensor, sample: torch.Tensor, sigma: torch.Tensor
) -> torch.Tensor:
    """The predicted original sample from sigma-scaled predicted noise (the Euler schedulers' step 1)."""
    prediction = scheduler.config.prediction_type
    if prediction == "epsilon":
        return sample - sigma * model_output
    if prediction == "v_prediction":
        return model_output * (-sigma / (sigma**2 + 1) ** 0.5) + (sample / (sigma**2 + 1))
    if prediction in ("sample", "original_sample") and type(scheduler) is EulerDiscreteScheduler:
        return model_output
    raise ValueError(f"{type(scheduler).__name__} does not take prediction_type {prediction!r}")


def euler_step(
    scheduler: Any, model_output: torch.Tensor, timestep: torch.Tensor, sample: torch.Tensor
) -> torch.Tensor:
    """``EulerDiscreteScheduler.step`` without churn (``s_churn`` 0: gamma 0, sigma_hat = sigma)."""
    # Copied from diffusers.schedulers.scheduling_euler_discrete.EulerDiscreteScheduler.step (0.42.1),
    # with s_churn 0 and without the s_tmin/s_tmax comparison it then does not need.
    index = _step_index(scheduler, timestep)
    sample = sample.to(torch.float32)
    sigma = scheduler.sigmas[index]
    pred_original_sample = _original_sample(scheduler, model_output, sample, sigma)
    derivative = (sample - pred_original_sample) / sigma
    dt = scheduler.sigmas[index + 1] - sigma
    prev_sample = sample + derivative * dt
    scheduler._step_index += 1
    return prev_sample.to(model_output.dtype)


def euler_ancestral_step(
    scheduler: Any,
    model_output: torch.Tensor,
    timestep: torch.Tensor,
    sample: torch.Tensor,
    generators: list[torch.Generator],
) -> torch.Tensor:
    """``EulerAncestralDiscreteScheduler.step``, its noise copied to the device without blocking."""
    # Copied from diffusers.schedulers.scheduling_euler_ancestral_discrete.EulerAncestralDiscreteScheduler.step
    # (0.42.1), the noise drawn as its randn_tensor draws it (drawn_noise).
    index = _step_index(scheduler, timestep)
    sigma = scheduler.sigmas[index]
    sample = sample.to(torch.float32)
    pred_original_sample = _original_sample(scheduler, model_output, sample, sigma)
    sigma_from, sigma_to = scheduler.sigmas[index], scheduler.sigmas[index + 1]
    sigma_up = (sigma_to**2 * (sigma_from**2 - sigma_to**2) / sigma_from**2) ** 0.5
    sigma_down = (sigma_to**2 - sigma_up**2) ** 0.5
    derivative = (sample - pred_original_sample) / sigma
    dt = sigma_down - sigma
    prev_sample = sample + derivative * dt
    prev_sample = prev_sample + drawn_noise(model_output, generators) * sigma_up
    scheduler._step_index += 1
    return prev_sample.to(model_output.dtype)


def drawn_noise(
    like: torch.Tensor, generators: list[torch.Generator], dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Noise of ``like``'s shape and ``dtype`` (``like``'s by default) as diffusers' ``randn_tensor``
    draws it for a scheduler's step (one image per CPU generator), copied to ``like``'s device from
    pinned memory without blocking."""
    shape = (1, *like.shape[1:])
    drawn = [torch.randn(shape, generator=generator, dtype=dtype or like.dtype) for generator in generators]
    return to_device(torch.cat(drawn), like.device)


def noise_table(scheduler: Any, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """What ``add_noise`` reads, copied to ``device`` once while a job from an image starts: the
    sigmas of a scheduler that steps by index, in ``dtype`` (as its ``add_noise`` copies them);
    DDIM's and PNDM's ``alphas_cumprod`` (``noised`` puts it where their first ``add_noise`` moves it)."""
    if steps_by_index(scheduler):
        return to_device(scheduler.sigmas, device, dtype)
    return to_device(scheduler.alphas_cumprod, device)


def noised(
    family: Any,
    scheduler: Any,
    original: torch.Tensor,
    noise: torch.Tensor,
    table: torch.Tensor,
    timesteps: torch.Tensor,
) -> torch.Tensor:
    """``original`` noised to the scheduler's step (timestep ``timesteps``, one per row), from
    ``noise_table``'s ``table``: ``add_noise`` (flow matching: ``scale_noise``)."""
    if not steps_by_index(scheduler):
        scheduler.alphas_cumprod = table  # where add_noise moves it; steps before it read the host table
        return family.add_noise(scheduler, original, noise, timesteps)
    # Copied from the schedulers' add_noise and scale_noise (diffusers 0.42.1), past their begin index:
    # the current step's index, else (before the first step) the begin index.
    step = scheduler.step_index if scheduler.step_index is not None else scheduler.begin_index
    sigma, kind = table[step], type(scheduler)
    if kind is DPMSolverMultistepScheduler:
        alpha_t, sigma_t = scheduler._sigma_to_alpha_sigma_t(sigma)  # type: ignore[attr-defined]  # DPM++'s
        return alpha_t * original + sigma_t * noise
    if kind is FlowMatchEulerDiscreteScheduler:
        return sigma * noise + (1.0 - sigma) * original
    return original + noise * sigma
