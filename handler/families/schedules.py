"""Scheduler steps that read no tensor value on the host, so that on a GPU nothing in a denoising
step waits for the device.

diffusers' schedulers (0.42.1) read values inside ``step`` in five ways, each a wait for the device
where the value lives there (diffusers #9485, #9475), and one spends the host's time:

- DDIM and PNDM index their CPU ``alphas_cumprod`` with the timestep and compare it with 0: six
  reads a step for DDIM, three for PNDM, when the timestep is the schedule's device tensor. Here
  they take it as a host number, from the CPU copy of the schedule a job keeps (``Family.scheduler``);
  their arithmetic is the same.
- Euler, Euler ancestral, LMS, Heun, DPM2, DPM++, UniPC and flow matching look their first step up by
  timestep value (``index_for_timestep``: ``nonzero`` and ``item``) unless a begin index is set. Every job sets one
  (``set_begin_index(0)``, or the first step of an image's schedule), as SDXL's pipeline does:
  the same step, as a schedule's first timestep is not repeated (Heun's and DPM2's repeat the others)
  and diffusers' image pipelines set the begin index too.
- Euler compares its sigma with ``s_tmin``/``s_tmax`` even without churn. ``euler_step`` is its
  arithmetic without churn (the server passes none), so without the comparison.
- Euler ancestral, DPM2 ancestral, DDIM with an ``eta`` above 0 and DPM++'s SDE algorithm
  (``dpmpp_2m_sde``, ``dpmpp_2m_sde_karras``) draw their noise on the CPU at every step and copy it
  to the device, which blocks. ``euler_ancestral_step`` is Euler ancestral's arithmetic with the
  noise drawn the same way and copied from pinned memory without blocking (``drawn_noise``); DDIM
  and DPM++ are given that noise as their ``variance_noise``; DPM2 ancestral's own step runs under
  ``QueuedCopies``, which queues its copy the same way.
- LMS integrates its coefficients at every step (scipy's ``quad`` over its host sigmas: no read of
  the device, but milliseconds of host time a step over its 0-dim tensors, during which the device
  may run dry). Its templates keep them, integrated at a step's first use over a NumPy copy of the
  sigmas (``base.LmsCoefficients``), and ``lms_step`` looks them up: a schedule's first job
  integrates, the jobs after it do not.
- UniPC copies each sigma it reads to the device and solves its coefficients' small linear system
  there (``torch.linalg.solve``, which reads its result's status: a wait). ``unipc_step`` is its
  arithmetic with the sigmas and coefficients on the host, the coefficients the latents meet copied
  to the device without blocking.

Heun and DPM2 take two model calls a step but the first (their schedules repeat each timestep but
the first): each call is a step of the job here, as each is an iteration of diffusers' loop.

A job from an image is noised to its first timestep (``add_noise``, flow matching's
``scale_noise``), and an inpainting job puts the image back at the next noise level after each
step. The schedulers that step by index copy their sigmas to the device at every call and index
them with a list (a blocking copy of the index); DDIM and PNDM copy their table there at their
first call (inpainting at strength 1: after its first step). ``noise_table`` makes that copy once,
queued while the job starts, and ``noised`` noises from it: by index, or DDIM's and PNDM's
``add_noise`` with the copy where their first call puts the table.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    KDPM2AncestralDiscreteScheduler,
    LMSDiscreteScheduler,
    UniPCMultistepScheduler,
)

from handler.families.base import LMS_ORDER, Scheduler, steps_by_index
from handler.families.transfer import queued_copies, to_device

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
    if type(scheduler) is UniPCMultistepScheduler:
        return unipc_step(scheduler, model_output, timestep, sample)
    if type(scheduler) is LMSDiscreteScheduler:
        return lms_step(scheduler, model_output, timestep, sample)
    noise_dtype = variance_noise_dtype(scheduler, model_output, step_kwargs)
    if noise_dtype is not None:  # its noise drawn as its step draws it
        noise = drawn_noise(model_output, step_kwargs["generator"], noise_dtype)
        step_kwargs = {**step_kwargs, "generator": None, "variance_noise": noise}
    argument = timestep_argument(scheduler, timestep, host_timestep)
    # DPM2 ancestral draws its noise on the host and copies it to the device (randn_tensor): queued
    with queued_copies(sample.device) if type(scheduler) is KDPM2AncestralDiscreteScheduler else nullcontext():
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
    if prediction == "sample" and type(scheduler) is LMSDiscreteScheduler:
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


def lms_step(scheduler: Any, model_output: torch.Tensor, timestep: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    """``LMSDiscreteScheduler.step`` (order 4, the pipelines'), its coefficients looked up in its
    template's (``base.LmsCoefficients``) instead of integrated at every step."""
    # Copied from diffusers.schedulers.scheduling_lms_discrete.LMSDiscreteScheduler.step (0.42.1), with
    # the coefficients of its step 3 looked up.
    index = _step_index(scheduler, timestep)
    sigma = scheduler.sigmas[index]
    pred_original_sample = _original_sample(scheduler, model_output, sample, sigma)
    derivative = (sample - pred_original_sample) / sigma
    scheduler.derivatives.append(derivative)
    if len(scheduler.derivatives) > LMS_ORDER:
        scheduler.derivatives.pop(0)
    coefficients = scheduler.lms_coefficients[index]  # from an image's step: more than its derivatives yet
    newest_first = reversed(scheduler.derivatives)
    prev_sample = sample + sum(c * d for c, d in zip(coefficients, newest_first, strict=False))
    scheduler._step_index += 1
    return prev_sample


def unipc_step(
    scheduler: Any, model_output: torch.Tensor, timestep: torch.Tensor, sample: torch.Tensor
) -> torch.Tensor:
    """``UniPCMultistepScheduler.step``: the corrector UniC on the sample this step starts from, then
    the predictor UniP to the next (``_unipc_update``)."""
    # Copied from diffusers.schedulers.scheduling_unipc_multistep.UniPCMultistepScheduler.step (0.42.1),
    # without solver_p (a predictor scheduler of its own, which from_config never sets).
    index = _step_index(scheduler, timestep)
    use_corrector = index > 0 and index - 1 not in scheduler.disable_corrector and scheduler.last_sample is not None
    converted = scheduler.convert_model_output(model_output, sample=sample)
    if use_corrector:
        sample = _unipc_update(scheduler, scheduler.last_sample, index, scheduler.this_order, converted)
    order = scheduler.config.solver_order
    for i in range(order - 1):
        scheduler.model_outputs[i] = scheduler.model_outputs[i + 1]
        scheduler.timestep_list[i] = scheduler.timestep_list[i + 1]
    scheduler.model_outputs[-1] = converted
    scheduler.timestep_list[-1] = timestep
    this_order = min(order, len(scheduler.timesteps) - index) if scheduler.config.lower_order_final else order
    scheduler.this_order = min(this_order, scheduler.lower_order_nums + 1)  # warm-up of the multistep
    scheduler.last_sample = sample
    prev_sample = _unipc_update(scheduler, sample, index, scheduler.this_order)
    if scheduler.lower_order_nums < order:
        scheduler.lower_order_nums += 1
    scheduler._step_index += 1
    return prev_sample


def _unipc_update(
    scheduler: Any,
    x: torch.Tensor,
    index: int,
    order: int,
    model_t: torch.Tensor | None = None,
) -> torch.Tensor:
    """UniP's step from sample ``x`` at step ``index`` to the next (``multistep_uni_p_bh_update``);
    with ``model_t`` (the converted model output at the sample after ``x``), UniC's correction of
    that sample instead (``multistep_uni_c_bh_update``). diffusers copies each sigma to the device
    (a blocking copy) and computes the coefficients there, solving their small linear system with
    ``linalg.solve``, which then reads its result's status: a wait. Here they are computed on the
    host from its sigmas (0-d CPU tensors, the same float32 arithmetic) and the ones the latents
    meet are copied to the device, queued."""
    # Copied from diffusers.schedulers.scheduling_unipc_multistep.UniPCMultistepScheduler's
    # multistep_uni_p_bh_update and multistep_uni_c_bh_update (0.42.1), which differ in the steps they
    # read (the corrector's one step back), the coefficients they solve for and the last line.
    s0 = index if model_t is None else index - 1
    alpha_t, sigma_t = scheduler._sigma_to_alpha_sigma_t(scheduler.sigmas[s0 + 1])
    alpha_s0, sigma_s0 = scheduler._sigma_to_alpha_sigma_t(scheduler.sigmas[s0])
    lambda_t = torch.log(alpha_t) - torch.log(sigma_t)
    lambda_s0 = torch.log(alpha_s0) - torch.log(sigma_s0)
    h = lambda_t - lambda_s0
    rks = []
    for i in range(1, order):
        alpha_si, sigma_si = scheduler._sigma_to_alpha_sigma_t(scheduler.sigmas[s0 - i])
        lambda_si = torch.log(alpha_si) - torch.log(sigma_si)
        rks.append((lambda_si - lambda_s0) / h)
    rks.append(torch.ones(()))
    rks_stacked = torch.stack(rks)
    hh = -h if scheduler.predict_x0 else h
    h_phi_1 = torch.expm1(hh)  # h\phi_1(h) = e^h - 1
    h_phi_k = h_phi_1 / hh - 1
    factorial_i = 1
    if scheduler.config.solver_type not in ("bh1", "bh2"):
        raise NotImplementedError(f"UniPC's solver_type {scheduler.config.solver_type!r}")
    B_h = hh if scheduler.config.solver_type == "bh1" else torch.expm1(hh)
    R, b = [], []
    for i in range(1, order + 1):
        R.append(torch.pow(rks_stacked, i - 1))
        b.append(h_phi_k * factorial_i / B_h)
        factorial_i *= i + 1
        h_phi_k = h_phi_k / hh - 1 / factorial_i
    R_stacked, b_stacked = torch.stack(R), torch.stack(b)
    half = torch.ones(1, dtype=x.dtype) * 0.5
    if model_t is None:  # UniP: order 2 takes a half, higher orders solve all but the last row
        rhos = half if order <= 2 else solved(R_stacked[:-1, :-1], b_stacked[:-1]).to(x.dtype)
    else:  # UniC: order 1 takes a half, higher orders solve the whole system
        rhos = half if order == 1 else solved(R_stacked, b_stacked).to(x.dtype)
    # What diffusers computes on the device, copied there in one queued copy each: the sample's and
    # m0's factors, the residual's, and the ratios the differences divide by (a CUDA kernel computes
    # with a device scalar as diffusers does, not with a host one: that rounds otherwise).
    if scheduler.predict_x0:
        factors = [sigma_t / sigma_s0, alpha_t * h_phi_1, alpha_t * B_h]
    else:
        factors = [alpha_t / alpha_s0, sigma_t * h_phi_1, sigma_t * B_h]
    on_device = to_device(torch.stack([*factors, *rks[:-1]]), x.device)
    sample_factor, m0_factor, residual_factor = on_device[0], on_device[1], on_device[2]
    rhos = to_device(rhos, x.device)
    outputs = scheduler.model_outputs
    m0 = outputs[-1]
    differences = [(outputs[-(i + 1)] - m0) / on_device[2 + i] for i in range(1, order)]
    weights = rhos if model_t is None else rhos[:-1]
    residual = torch.einsum("k,bkc...->bc...", weights, torch.stack(differences, dim=1)) if differences else 0
    x_t_ = sample_factor * x - m0_factor * m0
    if model_t is None:
        x_t = x_t_ - residual_factor * residual
    else:
        x_t = x_t_ - residual_factor * (residual + rhos[-1] * (model_t - m0))
    return x_t.to(x.dtype)


def solved(matrix: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
    """``torch.linalg.solve(matrix, vector)`` without reading its status: UniPC's systems are
    Vandermonde matrices of distinct log-SNR ratios, never singular."""
    return torch.linalg.solve_ex(matrix, vector).result


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
    if kind in (DPMSolverMultistepScheduler, UniPCMultistepScheduler):
        alpha_t, sigma_t = scheduler._sigma_to_alpha_sigma_t(sigma)  # type: ignore[attr-defined]  # theirs
        return alpha_t * original + sigma_t * noise
    if kind is FlowMatchEulerDiscreteScheduler:
        return sigma * noise + (1.0 - sigma) * original
    return original + noise * sigma
