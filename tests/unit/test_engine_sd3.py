"""SD 3.x on the step engine against diffusers' own pipeline calls (tiny random-weight SD 3 Medium
and SD 3.5 Medium shapes): alone, joining running jobs with their own steps and guidance (0 as
Large Turbo takes it), text encoding shared by jobs started together, image-to-image and
inpainting (decoded with the VAE's shift, where diffusers' inpaint pipeline leaves it out), dynamic
shifting, serving without T5; and the family's rules (LoRAs: ``test_engine_loras.py``)."""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.reference import Reference
from handler.config import FamilyRules, HandlerSettings, SkipLayerGuidance, StepCache
from handler.engine.loading import load_engine
from handler.engine.step_engine import StepEngine
from handler.families import StableDiffusion3Family, base
from server.paths import TINY_MODEL_DIRS
from tests.harness.engine_runs import (
    assert_moved_without,
    assert_same_images,
    expected,
    hole,
    picture,
    run,
    run_together_as_diffusers,
)
from tests.harness.engine_runs import spec as any_family_spec
from tests.harness.images import assert_moved

FAMILIES = ("sd3", "sd35")
FLOW = "flow_match_euler"


def count_forward_rows(engine: StepEngine, monkeypatch) -> list[int]:
    """The rows of each denoiser forward the engine runs from now on (around the family's call)."""
    rows, forward = [], engine.family.forward

    def counted(latents, *args, **kwargs):
        rows.append(latents.shape[0])
        return forward(latents, *args, **kwargs)

    monkeypatch.setattr(engine.family, "forward", counted)
    return rows


# SD 3 jobs: the family's scheduler, guidance 5.
spec = functools.partial(any_family_spec, scheduler=FLOW, guidance=5.0)


def engine_for(model_dir: Path, **settings) -> StepEngine:
    return load_engine(HandlerSettings.model_validate({"model_path": str(model_dir), **settings}), "/unused")


@pytest.fixture(scope="module")
def engines() -> dict[str, StepEngine]:
    return {family: engine_for(TINY_MODEL_DIRS[family]) for family in FAMILIES}


@pytest.fixture(scope="module")
def references() -> dict[str, Reference]:
    return {family: Reference(TINY_MODEL_DIRS[family]) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_job_alone_gives_diffusers_images(engines, references, family):
    job = spec(images=2, negative="blue")
    (decoded,) = run(engines[family], [(0, job)])
    assert_same_images(decoded, expected(references[family], job))


@pytest.mark.parametrize("family", FAMILIES)
def test_jobs_joining_mid_flight_with_their_own_steps_and_guidance_give_diffusers_images(engines, references, family):
    plan = [
        (0, spec("a red circle", seed=1, steps=6)),
        (1, spec("a green triangle", seed=2, images=2, steps=2, guidance=1.0)),
        (2, spec("a yellow square", seed=4, steps=4, guidance=0.0, negative="ignored without guidance")),
        (2, spec("a blue square", seed=5, steps=3, guidance=8.0, negative="")),
    ]
    for (_, job), decoded in zip(plan, run(engines[family], plan), strict=True):
        assert_same_images(decoded, expected(references[family], job))


def test_jobs_started_together_share_one_text_encoder_call(engines, references, monkeypatch):
    engine = engines["sd3"]
    jobs = [
        spec("a red circle", seed=1, steps=3),
        spec("a red circle", seed=5, images=2, steps=3, negative="red"),
        spec("a green triangle", seed=2, steps=2, guidance=1.0),
    ]
    decoded, calls = run_together_as_diffusers(engine, references["sd3"], jobs, monkeypatch)
    assert calls == 1


def test_jobs_with_a_clip_skip_give_diffusers_images_with_it(engines, references, monkeypatch):
    """The CLIP encoders' hidden states ``clip_skip`` layers earlier (T5's and the pooled
    projections as they are): one text-encoder call per value among jobs started together, the
    negative prompts in the call without one, as ``encode_prompt`` encodes them."""
    engine = engines["sd3"]
    jobs = [
        spec("a red circle", seed=1, steps=3),
        spec("a red circle", seed=1, steps=3, clip_skip=1, negative="red"),
        spec("a green triangle", seed=2, images=2, steps=2, clip_skip=engine.family.rules.max_clip_skip),
    ]
    decoded, calls = run_together_as_diffusers(engine, references["sd3"], jobs, monkeypatch)
    assert calls == 3
    assert_moved_without(engine, jobs[1], decoded[1], clip_skip=None)


def test_jobs_with_each_text_encoders_own_prompts_give_diffusers_images_with_them(engines, references, monkeypatch):
    """``prompt_2`` (CLIP-G), ``prompt_3`` (T5) and their negatives, each the prompt's or the
    negative prompt's where left out (a ``negative_prompt_2`` alone beside "" for the others, SD 3
    having no zero negative): one text-encoder call per ``clip_skip`` among jobs started together,
    each image diffusers' call with them."""
    engine = engines["sd3"]
    jobs = [
        spec("a red circle", seed=1, steps=3),
        spec("a red circle", seed=1, steps=3, prompt_2="a blue square", prompt_3="a green triangle"),
        spec("a red circle", seed=1, steps=3, prompt_3="a green triangle", negative_prompt_2="red"),
        spec(
            "a yellow square",
            seed=2,
            images=2,
            steps=3,
            guidance=12.0,
            negative="blue",
            negative_prompt_3="green triangles on a black field",
            clip_skip=1,
        ),
    ]
    decoded, calls = run_together_as_diffusers(engine, references["sd3"], jobs, monkeypatch)
    assert calls == 2
    assert_moved(decoded[1].images[0], decoded[0].images[0], "prompt_2 and prompt_3")
    assert_moved_without(engine, jobs[2], decoded[2], negative_prompt_2=None)
    assert_moved_without(engine, jobs[3], decoded[3], negative_prompt_3=None)


@pytest.mark.parametrize("family", FAMILIES)
def test_jobs_with_skip_layer_guidance_share_forwards_and_give_diffusers_images(
    engines, references, family, monkeypatch
):
    """Skip-layer guidance with its own blocks, scale and window per job (diffusers' defaults for
    one), beside a job without it: its rows join the step's one forward at the steps it acts, each
    image diffusers' call with it; it moves the image."""
    engine = engines[family]
    jobs = [
        spec("a red circle", seed=1, steps=6),
        spec("a red circle", seed=1, images=2, steps=6, skip_layer_guidance=SkipLayerGuidance((1,), stop=0.5)),
        spec(
            "a yellow square",
            seed=3,
            steps=5,
            negative="blue",
            skip_layer_guidance=SkipLayerGuidance((2, 0), scale=4.0, start=0.2, stop=0.9),
        ),
        spec("a blue square", seed=4, steps=12, skip_layer_guidance=SkipLayerGuidance((1,))),
    ]
    rows = count_forward_rows(engine, monkeypatch)
    decoded, _ = run_together_as_diffusers(engine, references[family], jobs, monkeypatch)
    # step 0: 2 + 4 + 2 + 2 rows; a skip-layer row per image of job 1 at steps 1 and 2 (6 x 0.01 < i
    # < 6 x 0.5), of job 2 at steps 2 to 4 (1 < i < 4.5), of job 3 at steps 1 and 2 (0.12 < i < 2.4)
    assert rows[:5] == [10, 13, 14, 11, 11]
    assert_moved_without(engine, jobs[1], decoded[1], skip_layer_guidance=None)
    assert_moved_without(engine, jobs[2], decoded[2], skip_layer_guidance=None)


@pytest.mark.parametrize("family", FAMILIES)
def test_skip_layer_guidance_beside_first_block_caching_gives_diffusers_images(engines, references, family):
    """A job with both runs its skip-layer rows through every block it does not skip, never cached:
    at threshold 0 it equals diffusers' call with skip-layer guidance alone; a skip-layer job shares
    the forward with cached jobs whose rows skip the blocks after the first (a sub-batch that leaves
    them out), and equals diffusers' call too; a job whose guided rows are cached still guides
    with its skip-layer rows (no diffusers call to equal: they move its image)."""
    engine, reference = engines[family], references[family]
    guidance = SkipLayerGuidance((1,), scale=3.0, start=0.0, stop=1.0)
    both = spec("a red circle", seed=1, steps=4, cache=first_block(0.0), skip_layer_guidance=guidance)
    cached = spec("a blue square", seed=2, steps=4, cache=first_block(0.5))
    skipping = spec("a yellow square", seed=3, steps=4, skip_layer_guidance=guidance)
    cached_skipping = spec("a green triangle", seed=4, steps=4, cache=first_block(0.5), skip_layer_guidance=guidance)
    running = engine.start([both, cached, skipping, cached_skipping])
    while not all(job.done for job in running):
        engine.step(running)
    assert running[1].cached_steps > 0 and running[3].cached_steps > 0
    for job, started in zip([both, cached, skipping], running[:3], strict=True):
        ours = engine.decode(started.latents, job.width, job.height)
        theirs = expected(reference, dataclasses.replace(job, cache=None) if job is both else job)
        assert_same_images(ours, theirs)
    last = engine.decode(running[3].latents, cached_skipping.width, cached_skipping.height)
    assert_moved_without(engine, cached_skipping, last, skip_layer_guidance=None)


def first_block(threshold: float) -> StepCache:
    return StepCache(mode="first_block", threshold=threshold)


@pytest.mark.parametrize("masked", [False, True], ids=["img2img", "inpaint"])
def test_skip_layer_guidance_from_an_image_acts_over_the_steps_it_runs(engines, masked):
    """diffusers' SD 3 img2img and inpaint pipelines have no skip-layer guidance (no call to equal):
    here its window spans the steps the job runs, as for text to image, and it moves the image."""
    engine = engines["sd3"]
    guidance = SkipLayerGuidance((1,), scale=4.0, start=0.0, stop=0.9)
    job = spec(
        steps=6, image=picture(64), mask=hole(64) if masked else None, strength=0.7, skip_layer_guidance=guidance
    )
    (decoded,) = run(engine, [(0, job)])
    assert_moved_without(engine, job, decoded, skip_layer_guidance=None)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("masked", "strength"), [(False, 0.6), (True, 1.0), (True, 0.7)])
def test_image_to_image_and_inpainting_give_the_img2img_and_inpaint_pipelines_images(
    engines, references, family, masked, strength
):
    job = spec(images=2, image=picture(64), mask=hole(64) if masked else None, strength=strength)
    (decoded,) = run(engines[family], [(0, job)])
    assert_same_images(decoded, expected(references[family], job))


@pytest.mark.parametrize("family", FAMILIES)
def test_jobs_with_their_own_sigmas_share_forwards_and_give_diffusers_images(engines, references, family):
    """A custom schedule (diffusers' ``sigmas``, shifted by the scheduler as diffusers shifts them),
    text to image and from an image, joining a job of the scheduler's own schedule."""
    plan = [
        (0, spec("a red circle", seed=1, steps=4, sigmas=(1.0, 0.8, 0.5, 0.2))),
        (0, spec("a blue square", seed=3, steps=5)),
        (1, spec("a green", seed=5, steps=3, sigmas=(0.9, 0.5, 0.1), image=picture(64), strength=0.7)),
        (1, spec("a star", seed=6, steps=4, sigmas=(1.0, 0.7, 0.4, 0.1), image=picture(64, 1), mask=hole(64))),
    ]
    for (_, job), decoded in zip(plan, run(engines[family], plan), strict=True):
        assert_same_images(decoded, expected(references[family], job))


def test_inpainting_decodes_with_the_vaes_shift_where_diffusers_inpaint_pipeline_leaves_it_out(engines, references):
    """The one place we knowingly differ from diffusers (its issue #13611): the reference decodes
    the inpaint pipeline's latents as the text-to-image pipeline does; its raw output is darker."""
    from diffusers import AutoPipelineForInpainting

    job = spec(image=picture(64), mask=hole(64), strength=0.7, steps=4)
    (decoded,) = run(engines["sd3"], [(0, job)])
    raw = AutoPipelineForInpainting.from_pipe(references["sd3"].pipeline)(
        prompt=job.prompt,
        image=job.image,
        mask_image=job.mask,
        strength=job.strength,
        num_inference_steps=job.num_inference_steps,
        guidance_scale=job.guidance_scale,
        generator=[torch.Generator("cpu").manual_seed(job.seeds[0])],
    ).images[0]
    difference = np.abs(np.asarray(decoded.images[0], dtype=np.int16) - np.asarray(raw, dtype=np.int16))
    assert difference.max() > 1
    assert_same_images(decoded, expected(references["sd3"], job))


def test_edits_share_forwards_with_text_to_image_jobs_and_each_gives_its_diffusers_image(engines, references):
    plan = [
        (0, spec("a red circle", seed=1, steps=5)),
        (0, spec("a green triangle", seed=2, steps=6, image=picture(64, 1), strength=0.5)),
        (2, spec("a blue square", seed=3, steps=6, image=picture(64, 2), mask=hole(64), strength=0.8)),
        (3, spec("a yellow star", seed=4, steps=5, guidance=1.0, image=picture(64, 3), strength=0.3)),
    ]
    for (_, job), decoded in zip(plan, run(engines["sd35"], plan), strict=True):
        assert_same_images(decoded, expected(references["sd35"], job))


@pytest.fixture(scope="module")
def dynamic_model(tmp_path_factory) -> Path:
    """The tiny SD 3 model with a scheduler that shifts by resolution (``use_dynamic_shifting``)."""
    directory = tmp_path_factory.mktemp("dynamic") / "model"
    shutil.copytree(TINY_MODEL_DIRS["sd3"], directory)
    config_file = directory / "scheduler" / "scheduler_config.json"
    config = json.loads(config_file.read_text())
    config.update(use_dynamic_shifting=True, base_image_seq_len=16, max_image_seq_len=256)
    config_file.write_text(json.dumps(config))
    return directory


def test_dynamic_shifting_gives_each_size_its_own_schedule_and_diffusers_images(dynamic_model):
    engine, reference = engine_for(dynamic_model), Reference(dynamic_model)
    small, large = spec(side=64, steps=4), spec(side=128, seed=2, steps=4)
    custom = spec(side=128, seed=3, steps=3, sigmas=(1.0, 0.6, 0.3))  # shifted by its size's mu too
    for job in (small, large, custom):
        (decoded,) = run(engine, [(0, job)])
        assert_same_images(decoded, expected(reference, job))
    shapes = [engine.latent_shape(side, side) for side in (64, 128)]
    schedules = [engine.family.scheduler(FLOW, 4, shape)[0].sigmas for shape in shapes]
    assert not torch.equal(*schedules), "the schedule should depend on the image's token count"


def test_scheduler_templates_per_image_size_are_bounded(dynamic_model, monkeypatch):
    """Each size has its own ``mu`` and so its own template; the family keeps the most recent few."""
    monkeypatch.setattr(base, "TEMPLATES_KEPT", 3)
    family = engine_for(dynamic_model).family
    sides = (32, 48, 64, 80, 96)
    for side in sides:
        family.scheduler(FLOW, 4, family.latent_shape(side, side))
    latest = [(FLOW, 4, tuple(family._timestep_options(family.latent_shape(side, side)).items()), ()) for side in sides]
    assert list(family._templates) == latest[-3:], "the three most recently used, oldest first"


def test_the_transformers_forward_takes_no_controlnet_residuals_its_blocks_add_them(engines):
    engine = engines["sd3"]
    (job,) = engine.start([spec(side=32)])
    latents = torch.cat([job.latents] * 2)
    with pytest.raises(ValueError, match="added between its blocks"):
        engine.family.forward(latents, job.timesteps[:1].expand(2), job.conditioning, [latents])


def test_without_t5_the_model_conditions_on_zeros_as_diffusers_does_without_its_encoder():
    engine = engine_for(TINY_MODEL_DIRS["sd3"], text_encoder_3=False)
    assert engine.pipeline.text_encoder_3 is None and "text_encoder_3=False" in engine.description
    assert engine.family.rules.text_encoders == 2  # no prompt_3 for an encoder it is served without
    job = spec(images=2, steps=4, negative="blue", prompt_2="a green triangle")
    (started,) = engine.start([job])
    t5_rows = started.conditioning.hidden_states[:, 77:]
    assert t5_rows.shape[1] == 256 and torch.count_nonzero(t5_rows) == 0
    (decoded,) = run(engine, [(0, job)])
    assert_same_images(decoded, expected(Reference(TINY_MODEL_DIRS["sd3"], text_encoder_3=False), job))


def test_a_directory_saved_without_t5_serves_without_it(tmp_path):
    """As a user may strip T5 from an SD 3.5 Large directory to save 9.5 GB: diffusers' own
    from_pretrained refuses such a directory unless told text_encoder_3=None; the worker tells it."""
    from diffusers import StableDiffusion3Pipeline

    pipeline = StableDiffusion3Pipeline.from_pretrained(TINY_MODEL_DIRS["sd3"], text_encoder_3=None, tokenizer_3=None)
    pipeline.save_pretrained(tmp_path / "no-t5", safe_serialization=True)
    engine = engine_for(tmp_path / "no-t5")
    assert engine.pipeline.text_encoder_3 is None and "text_encoder_3=False" in engine.description


def test_max_sequence_length_sets_the_t5_tokens():
    engine = engine_for(TINY_MODEL_DIRS["sd3"], max_sequence_length=128)
    (job,) = engine.start([spec(guidance=1.0)])
    assert job.conditioning.hidden_states.shape[1] == 77 + 128


def test_the_family_is_detected_with_its_rules(engines):
    for family in FAMILIES:
        engine = engines[family]
        assert isinstance(engine.family, StableDiffusion3Family) and engine.family.name == "SD 3.x"
        assert "family=SD 3.x pipeline=StableDiffusion3Pipeline denoiser=transformer" in engine.description
        assert "JointAttnProcessor2_0" in engine.description
        assert engine.family.native_size() == (64, 64) and engine.latent_shape(64, 48) == (16, 6, 8)
    rules = engines["sd3"].family.rules
    # the tiny CLIP encoders have 5 layers, and SD 3 conditions on their penultimate hidden states
    assert rules == FamilyRules(
        "SD 3.x",
        (FLOW,),
        FLOW,
        16,
        "start",
        max_side=32 * 2 * 8,
        max_clip_skip=3,
        guidance_rescale=False,
        text_encoders=3,
        custom_schedules=((FLOW, ("sigmas",)),),
        max_sigma=1.0,
        eta_schedulers=(),
        controlnet_excludes=("image", "skip_guidance_layers", "cache"),
        two_call_schedulers=(),
    )
    assert [rules.image_steps(steps, strength) for steps, strength in ((5, 0.7), (2, 0.3), (10, 1.0))] == [4, 1, 10]
    assert [FamilyRules().image_steps(steps, strength) for steps, strength in ((5, 0.7), (2, 0.3))] == [3, 0]


def test_attention_slicing_is_refused_for_the_joint_attention_transformer():
    with pytest.raises(ValueError, match="attention_slicing is not available for SD 3.x"):
        engine_for(TINY_MODEL_DIRS["sd3"], attention_slicing=True)
