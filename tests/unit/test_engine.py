"""The step engine against diffusers' own pipeline call, per family (tiny random-weight pipelines):
alone, for every scheduler, and joining running jobs mid-flight with their own steps, scheduler
and guidance; SDXL's conditioning and float16 VAE; the safety checker; unsupported pipelines."""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import get_args

import numpy as np
import pytest
import torch
from diffusers import LMSDiscreteScheduler

from bench.reference import Reference
from bench.schedules import run_schedule
from handler.config import UNET_SCHEDULERS, FamilyRules, HandlerSettings, SchedulerName, SizeConditioning
from handler.engine.jobs import JobSpec
from handler.engine.loading import load_engine
from handler.engine.step_engine import StepEngine
from handler.families import SCHEDULERS as ALL_SCHEDULERS
from handler.families import UnsupportedPipeline
from handler.families.sd import SCHEDULERS
from model_making.make_tiny_model import write_lcm_model
from server.paths import TINY_MODEL_DIRS
from tests.harness.engine_runs import (
    assert_moved_without,
    assert_same_images,
    expected,
    hole,
    picture,
    run,
    run_together_as_diffusers,
    spec,
    tiny_engine,
)
from tests.harness.images import assert_moved

FAMILIES = ("sd1", "sd2", "sdxl")


@pytest.fixture(scope="module")
def engines() -> dict[str, StepEngine]:
    return {family: tiny_engine(family) for family in (*FAMILIES, "sd1-safety")}


@pytest.fixture(scope="module")
def references() -> dict[str, Reference]:
    return {family: Reference(TINY_MODEL_DIRS[family]) for family in (*FAMILIES, "sd1-safety")}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
def test_a_job_alone_gives_diffusers_image(engines, references, family, scheduler):
    side = 96 if family == "sd2" else 64  # SD 2.x's native size here; the others' is 64
    job = spec(images=2, side=side, scheduler=scheduler)
    (decoded,) = run(engines[family], [(0, job)])
    assert_same_images(decoded, expected(references[family], job))


@pytest.mark.parametrize("family", FAMILIES)
def test_jobs_joining_mid_flight_with_their_own_steps_scheduler_and_guidance_give_diffusers_images(
    engines, references, family
):
    plan = [
        (0, spec("a red circle", seed=1, steps=8)),
        (3, spec("a green triangle", seed=2, images=2, steps=5, scheduler="euler_a", guidance=1.0)),
        (4, spec("a yellow square", seed=4, steps=4, scheduler="dpmpp_2m", guidance=3.0, negative="blue")),
        (2, spec("a blue star", seed=6, images=2, steps=5, scheduler="dpmpp_2m_sde_karras")),  # noise each step
        (1, spec("a red square", seed=7, steps=6, scheduler="unipc", guidance=5.0)),  # corrects each step
        (5, spec("a green star", seed=8, steps=3, scheduler="heun")),  # two calls a step
        (2, spec("a yellow circle", seed=10, steps=5, scheduler="lms_karras", guidance=2.0)),  # multistep
        (6, spec("a blue square", seed=9, images=2, steps=4, scheduler="dpm2_a_karras", guidance=4.0)),
    ]
    for (_, job), decoded in zip(plan, run(engines[family], plan), strict=True):
        assert_same_images(decoded, expected(references[family], job))


@pytest.mark.parametrize("family", FAMILIES)
def test_jobs_started_together_share_one_text_encoder_call_and_each_gives_its_diffusers_image(
    engines, references, family, monkeypatch
):
    """Different prompts, negative prompts (absent, empty, given; given without guidance, which
    diffusers ignores), guidance on and off, image counts and schedulers, jobs with the same
    scheduler and steps (each its own copy)."""
    side = 96 if family == "sd2" else 64
    jobs = [
        spec("a red circle", seed=1, side=side, steps=4),
        spec("a red circle", seed=5, images=2, side=side, steps=4, negative=""),
        spec("a green triangle", seed=2, side=side, steps=4, scheduler="dpmpp_2m", guidance=1.0, negative="red"),
        spec("a yellow square", seed=4, side=side, steps=3, scheduler="dpmpp_2m", guidance=3.0, negative="blue"),
        spec("a blue circle", seed=6, side=side, steps=3, scheduler="dpmpp_2m_karras", negative="a red circle"),
    ]
    engine = engines[family]
    decoded, calls = run_together_as_diffusers(engine, references[family], jobs, monkeypatch)
    assert calls == 1


@pytest.mark.parametrize("family", FAMILIES)
def test_jobs_with_a_clip_skip_give_diffusers_images_with_it(engines, references, family, monkeypatch):
    """Jobs started together without a ``clip_skip``, with 0 (diffusers' default too), with 1 and a
    negative prompt (which ``encode_prompt`` encodes without it) and with the most the tiny text
    encoders allow: one text-encoder call per value, each image diffusers' call with its
    ``clip_skip`` (SD 1.x/2.x's through diffusers PR #14043's reading of the flattened
    ``CLIPTextModel``)."""
    side = 96 if family == "sd2" else 64
    engine = engines[family]
    jobs = [
        spec(seed=1, side=side, steps=4),
        spec(seed=1, side=side, steps=4, clip_skip=0),
        spec(seed=1, side=side, steps=4, clip_skip=1, negative="blue"),
        spec("a green triangle", seed=2, images=2, side=side, steps=4, clip_skip=engine.family.rules.max_clip_skip),
    ]
    decoded, calls = run_together_as_diffusers(engine, references[family], jobs, monkeypatch)
    assert calls == 3
    assert_moved_without(engine, jobs[2], decoded[2], clip_skip=None)


@pytest.mark.parametrize("family", FAMILIES)
def test_jobs_with_a_guidance_rescale_give_diffusers_images_with_it(engines, references, family):
    """``guidance_rescale`` per job (diffusers' ``rescale_noise_cfg`` on its own rows), beside
    jobs without it and an unguided one, which ignores it as diffusers does; SDXL's img2img and
    inpaint pipelines take it too. diffusers' SD 1.x/2.x img2img and inpaint pipelines have none:
    there it applies as the text-to-image pipeline applies it (README), which moves the image."""
    side = 96 if family == "sd2" else 64
    engine = engines[family]
    plan = [
        (0, spec(seed=1, side=side, steps=5, guidance=12.0, rescale=1.0)),
        (0, spec(seed=1, side=side, steps=5, guidance=12.0)),
        (0, spec("a green triangle", seed=2, images=2, side=side, steps=4, scheduler="euler_a", rescale=1.0)),
        (1, spec("a yellow square", seed=3, side=side, steps=3, guidance=1.0, rescale=0.5)),
    ]
    if family == "sdxl":
        plan.append((1, spec(seed=4, side=side, steps=4, image=picture(side), strength=0.8, rescale=0.7)))
        plan.append((1, spec(seed=5, side=side, steps=4, image=picture(side), mask=hole(side), rescale=0.7)))
    decoded = run(engine, plan)
    for (_, job), images in zip(plan, decoded, strict=True):
        assert_same_images(images, expected(references[family], job))
    assert_moved(decoded[0].images[0], decoded[1].images[0], "guidance_rescale 1")
    if family != "sdxl":
        job = spec(seed=4, side=side, steps=4, guidance=12.0, image=picture(side), strength=0.8, rescale=1.0)
        rescaled, plain = run(engine, [(0, job), (0, replace(job, guidance_rescale=0.0))])
        assert_moved(rescaled.images[0], plain.images[0], "guidance_rescale from an image")


def test_sdxl_jobs_with_the_second_encoders_prompts_give_diffusers_images_with_them(engines, references, monkeypatch):
    """``prompt_2`` and ``negative_prompt_2`` (what SDXL's second text encoder reads; else the
    prompt's and the negative prompt's), beside jobs without them and one whose ``prompt_2`` is its
    prompt: one text-encoder call, each image diffusers' call with them."""
    engine = engines["sdxl"]
    jobs = [
        spec(seed=1, steps=4),
        spec(seed=1, steps=4, prompt_2="a blue square"),
        spec(seed=1, steps=4, prompt_2="a red circle"),
        spec("a green triangle", seed=2, images=2, steps=4, negative="red", prompt_2="a yellow square"),
        spec(seed=3, steps=3, scheduler="euler_a", negative="", negative_prompt_2="a red circle"),
    ]
    decoded, calls = run_together_as_diffusers(engine, references["sdxl"], jobs, monkeypatch)
    assert calls == 1
    assert_moved(decoded[1].images[0], decoded[0].images[0], "prompt_2")
    assert_moved_without(engine, jobs[4], decoded[4], negative_prompt_2=None)


def test_sdxl_jobs_with_their_own_sizes_and_crops_give_each_pipelines_images(engines, references, monkeypatch):
    """SDXL's size and crop conditioning (time ids) per job, as each pipeline reads it: text to image
    with its sizes and crop (guided, and not), and with both negative sizes and a negative crop (two
    images: each row with its own side's ids, diffusers' call per image); image to image and
    inpainting with one negative size each (the other, and the crop, the positive ones), all in
    one forward, each image diffusers' call with them."""
    engine = engines["sdxl"]
    negatives = SizeConditioning(negative_original_size=(32, 32), negative_target_size=(48, 48))
    jobs = [
        spec(seed=1, steps=4),
        spec(seed=1, steps=4, size_conditioning=SizeConditioning((128, 96), (8, 16), (64, 64))),
        spec(
            seed=2,
            images=2,
            steps=4,
            negative="blue",
            size_conditioning=replace(negatives, negative_crops_coords_top_left=(4, 4)),
        ),
        spec(
            seed=3,
            steps=4,
            image=picture(64),
            strength=0.8,
            size_conditioning=SizeConditioning((96, 96), (8, 8), negative_original_size=(16, 16)),
        ),
        spec(
            seed=4,
            steps=4,
            image=picture(64, 1),
            mask=hole(64),
            strength=0.9,
            size_conditioning=SizeConditioning(negative_target_size=(128, 128)),
        ),
        spec(seed=5, steps=4, guidance=1.0, size_conditioning=SizeConditioning(target_size=(32, 128))),
    ]
    decoded, _ = run_together_as_diffusers(engine, references["sdxl"], jobs, monkeypatch)
    assert_moved(decoded[1].images[0], decoded[0].images[0], "original_size, crops_coords_top_left, target_size")
    assert_moved_without(engine, jobs[2], decoded[2], size_conditioning=None)
    assert_moved_without(
        engine, jobs[3], decoded[3], size_conditioning=replace(jobs[3].size_conditioning, negative_original_size=None)
    )
    assert_moved_without(engine, jobs[4], decoded[4], size_conditioning=None)
    assert_moved_without(engine, jobs[5], decoded[5], size_conditioning=None)


def test_the_prompts_a_job_may_give_are_one_per_text_encoder(engines):
    """SD 1.x/2.x one, SDXL two (its unguided rows zeros without a negative prompt)."""
    rules = [engines[family].family.rules for family in FAMILIES]
    assert [(rule.text_encoders, rule.zeros_without_negative) for rule in rules] == [(1, False), (1, False), (2, True)]


def test_the_most_layers_a_prompt_may_skip_leave_each_clip_encoder_a_layer(engines):
    """SD 1.x/2.x condition on the last hidden states, SDXL on the penultimate; the tiny CLIP
    encoders have 5 layers."""
    assert [engines[family].family.rules.max_clip_skip for family in FAMILIES] == [4, 4, 3]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "scheduler", ["ddim", "euler_a", "lms", "heun", "dpm2_a", "dpmpp_2m", "dpmpp_2m_sde_karras", "unipc"]
)
@pytest.mark.parametrize(("masked", "strength"), [(False, 0.6), (True, 1.0), (True, 0.7)])
def test_image_to_image_and_inpainting_give_the_img2img_and_inpaint_pipelines_images(
    engines, references, family, scheduler, masked, strength
):
    side = 96 if family == "sd2" else 64
    job = spec(
        images=2,
        side=side,
        scheduler=scheduler,
        image=picture(side),
        mask=hole(side) if masked else None,
        strength=strength,
    )
    (decoded,) = run(engines[family], [(0, job)])
    assert_same_images(decoded, expected(references[family], job))


@pytest.mark.parametrize("family", FAMILIES)
def test_edits_share_forwards_with_text_to_image_jobs_and_each_gives_its_diffusers_image(engines, references, family):
    """Few steps: the tiny random SDXL amplifies float rounding between batch sizes by ~4x per step."""
    side = 96 if family == "sd2" else 64
    plan = [
        (0, spec("a red circle", seed=1, side=side, steps=5)),
        (0, spec("a green triangle", seed=2, side=side, steps=6, image=picture(side, 1), strength=0.5)),
        (
            2,
            spec(
                "a blue square",
                seed=3,
                side=side,
                steps=6,
                scheduler="euler_a",
                image=picture(side, 2),
                mask=hole(side),
            ),
        ),
        (
            3,
            spec(
                "a yellow star", seed=4, side=side, steps=5, scheduler="dpmpp_2m", guidance=1.0, image=picture(side, 3)
            ),
        ),
    ]
    for (_, job), decoded in zip(plan, run(engines[family], plan), strict=True):
        assert_same_images(decoded, expected(references[family], job))


@pytest.mark.parametrize("family", FAMILIES)
def test_jobs_with_their_own_timesteps_or_sigmas_share_forwards_and_give_diffusers_images(engines, references, family):
    """Custom schedules (diffusers' ``timesteps``, Euler's ``sigmas`` ending with the final one), text to
    image and from an image (Heun's from text: two calls a step), joining a job of the scheduler's own schedule."""
    side = 96 if family == "sd2" else 64
    euler, dpm, heun = (functools.partial(spec, side=side, scheduler=name) for name in ("euler", "dpmpp_2m", "heun"))
    image, inpaint = {"image": picture(side), "strength": 0.6}, {"image": picture(side, 1), "mask": hole(side)}
    plan = [
        (0, euler("a red circle", seed=1, steps=4, timesteps=(999, 700, 400, 100))),
        (0, euler("a blue square", seed=3, steps=3, sigmas=(10.0, 3.0, 0.5, 0.0))),
        (0, dpm("a green", seed=5, steps=4, timesteps=(950, 600, 250, 20))),
        (1, euler("a star", seed=7, steps=5)),
        (1, dpm("a moon", seed=8, steps=4, timesteps=(900, 650, 300, 1), **image)),
        (1, euler("a sun", seed=9, steps=3, sigmas=(8.0, 2.0, 0.4, 0.0), strength=0.9, **inpaint)),
        (2, heun("a cloud", seed=10, steps=3, timesteps=(900, 500, 100))),  # two calls a step (from text only)
    ]
    for (_, job), decoded in zip(plan, run(engines[family], plan), strict=True):
        assert_same_images(decoded, expected(references[family], job))


@pytest.mark.parametrize("family", FAMILIES)
def test_ddim_jobs_with_an_eta_draw_their_noise_from_their_seeds_as_diffusers_does(engines, references, family):
    """DDIM's ``eta``: each step's fresh noise from the image's generator (text to image, from an
    image, inpainting), beside a deterministic DDIM job and another scheduler's in the same forwards."""
    side = 96 if family == "sd2" else 64
    ddim = functools.partial(spec, side=side, steps=4)
    plan = [
        (0, ddim("a red circle", seed=1, images=2, eta=0.5)),
        (0, ddim("a blue square", seed=3)),
        (1, ddim("a green", seed=5, eta=1.0, image=picture(side), strength=0.7)),
        (1, ddim("a moon", seed=6, eta=0.3, image=picture(side, 1), mask=hole(side), strength=0.9)),
        (1, spec("a star", seed=7, side=side, steps=3, scheduler="euler_a")),
    ]
    decoded = run(engines[family], plan)
    for (_, job), images in zip(plan, decoded, strict=True):
        assert_same_images(images, expected(references[family], job))
    (deterministic,) = run(engines[family], [(0, replace(plan[0][1], eta=0.0))])
    assert_moved(decoded[0].images[0], deterministic.images[0], "eta")


def test_one_forward_needs_one_latent_shape(engines):
    engine = engines["sd1"]
    with pytest.raises(ValueError, match="one latent shape"):
        engine.step(engine.start([spec(side=64), spec(side=128)]))


def test_the_request_rules_name_the_schedulers_the_families_build():
    """config.UNET_SCHEDULERS (the request rules' default, which cannot import the families) and
    every family's scheduler names are the ones its module builds, all of them request names."""
    assert UNET_SCHEDULERS == tuple(SCHEDULERS)
    assert set(ALL_SCHEDULERS) == set(get_args(SchedulerName))


def test_families_are_detected_from_the_loaded_pipeline(engines):
    assert [engines[family].family.name for family in FAMILIES] == ["SD 1.x", "SD 2.x", "SDXL"]
    assert {engines[family].family.rules.max_steps for family in FAMILIES} == {998}  # their training timesteps, less 2
    # what the UNet families' schedulers take of a custom schedule: the request rules' default
    assert {engines[family].family.rules.custom_schedules for family in FAMILIES} == {FamilyRules().custom_schedules}
    assert {round(engines[family].family.rules.max_sigma, 4) for family in FAMILIES} == {FamilyRules().max_sigma}
    assert {engines[family].family.rules.eta_schedulers for family in FAMILIES} == {FamilyRules().eta_schedulers}
    assert {engines[family].family.rules.two_call_schedulers for family in FAMILIES} == {
        FamilyRules().two_call_schedulers
    }
    assert "family=SDXL pipeline=StableDiffusionXLPipeline" in engines["sdxl"].description


def test_sdxl_without_negative_prompt_conditions_on_zeros_and_on_its_size(engines):
    engine = engines["sdxl"]
    absent, empty = engine.start([spec(images=2, side=64), spec(images=2, side=64, negative="")])
    negative_rows = absent.conditioning.hidden_states[:2]
    assert (
        torch.count_nonzero(negative_rows) == 0
        and torch.count_nonzero(absent.conditioning.added["text_embeds"][:2]) == 0
    )
    assert torch.count_nonzero(empty.conditioning.hidden_states[:2]) > 0, "an explicit empty negative prompt is encoded"
    (wide,) = engine.start([JobSpec("x", None, (0,), 128, 64, 2, "ddim", 7.5)])
    assert wide.conditioning.added["time_ids"].tolist() == [[64.0, 128.0, 0.0, 0.0, 64.0, 128.0]] * 2


def test_sdxl_in_float16_decodes_in_float32_like_diffusers():
    engine = tiny_engine("sdxl", dtype="float16")
    assert engine.pipeline.unet.dtype == torch.float16 and engine.pipeline.vae.dtype == torch.float32
    job = spec(seed=3, steps=4)
    (decoded,) = run(engine, [(0, job)])
    assert_same_images(decoded, expected(Reference(TINY_MODEL_DIRS["sdxl"], dtype=torch.float16), job))


def test_the_safety_checker_flags_as_diffusers_does_and_blacks_the_image(engines, references):
    calibration = spec("flag this picture", seed=0, steps=4)
    other = spec("flag this picture", seed=1, steps=4)
    flagged, passed = run(engines["sd1-safety"], [(0, calibration), (0, other)])
    assert flagged.nsfw_content_detected == [True] and passed.nsfw_content_detected == [False]
    assert np.asarray(flagged.images[0]).max() == 0 and np.asarray(passed.images[0]).max() > 0
    assert_same_images(flagged, expected(references["sd1-safety"], calibration))
    assert_same_images(passed, expected(references["sd1-safety"], other))


def test_the_safety_checker_can_be_turned_off():
    engine = tiny_engine("sd1-safety", safety_checker=False)
    assert "safety_checker=off" in engine.description
    (decoded,) = run(engine, [(0, spec("flag this picture", seed=0, steps=4))])
    assert decoded.nsfw_content_detected is None and np.asarray(decoded.images[0]).max() > 0
    reference = Reference(TINY_MODEL_DIRS["sd1-safety"])
    reference.pipeline.safety_checker = None
    assert_same_images(decoded, expected(reference, spec("flag this picture", seed=0, steps=4)))


def test_an_unsupported_pipeline_is_refused_at_load_naming_it_and_the_supported_ones(tmp_path, engines):
    write_lcm_model(tmp_path / "lcm", engines["sd1"].pipeline)
    with pytest.raises(
        UnsupportedPipeline, match="LatentConsistencyModelPipeline is not supported.*StableDiffusionXLPipeline"
    ):
        load_engine(HandlerSettings(model_path=str(tmp_path / "lcm")), "/unused")


def last_latents(family, scheduler: SchedulerName, steps: int) -> torch.Tensor:
    """Latents through a whole schedule with random model outputs (no denoiser)."""
    return run_schedule(family, scheduler, steps).latents


def test_an_lms_schedule_integrates_a_steps_coefficients_at_its_first_use_and_keeps_them(engines, monkeypatch):
    """A new LMS schedule integrates none of its coefficients as its first job starts (a thousand
    steps' took seconds, during which every job in flight waited): its first job's steps integrate
    theirs, and the next job of that schedule integrates none and steps the same."""
    family, steps = engines["sd1"].family, engines["sd1"].family.rules.max_steps - 1  # a schedule no test made
    with monkeypatch.context() as patched:
        patched.setattr(LMSDiscreteScheduler, "get_lms_coefficient", None)
        stepper, _ = family.scheduler("lms", steps, (4, 8, 8))
    assert stepper.lms_coefficients.integrated == 0
    first = last_latents(family, "lms", steps)
    assert stepper.lms_coefficients.integrated == steps, "the template's copies share its coefficients"
    with monkeypatch.context() as patched:
        patched.setattr(LMSDiscreteScheduler, "get_lms_coefficient", None)
        second = last_latents(family, "lms", steps)
    torch.testing.assert_close(second, first, rtol=0, atol=0)


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
def test_every_scheduler_takes_the_most_steps_the_family_allows(engines, scheduler):
    """At the family's ``max_steps`` each schedule steps to finite latents; one step more, DPM++
    2M's do not (and at two more, DDIM and PNDM index past their table)."""
    family = engines["sd1"].family
    assert torch.isfinite(last_latents(family, scheduler, family.rules.max_steps)).all()
    if scheduler == "dpmpp_2m":
        assert not torch.isfinite(last_latents(family, scheduler, family.rules.max_steps + 1)).all()
