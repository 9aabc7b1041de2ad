"""Step-engine jobs run in-process as the service runs them (joining between steps, each decoded as
it finishes), and their images compared with diffusers' own call: what the engine tests of every
family share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
from PIL import Image

from bench.reference import ControlNetCall, Reference, cache_options
from handler.adapters.controlnets import ControlSpec
from handler.config import OTHER_PROMPTS, FamilyRules, HandlerSettings, SkipLayerGuidance, StepCache
from handler.engine.jobs import DenoiseJob, JobSpec
from handler.engine.loading import load_engine
from handler.engine.step_engine import StepEngine
from handler.families import Decoded
from handler.service.loops import build_service
from model_making.make_controlnet import write_controlnet
from model_making.make_lora import write_lora
from server.paths import CONTROLNET_DIR, TINY_MODEL_DIRS
from tests.harness.images import assert_moved

# Jobs stepped together and alone differ by float rounding only; in 8 bits an image may differ by
# this much per channel value (0-255).
TOLERANCE = 1


def spec(
    prompt="a red circle",
    seed=1,
    images=1,
    side=64,
    steps=5,
    scheduler="ddim",
    guidance=7.5,
    negative=None,
    image=None,
    mask=None,
    strength=1.0,
    adapters=(),
    controls=(),
    cache=None,
    clip_skip=None,
    rescale=0.0,
    **more,
) -> JobSpec:
    """A job of ``images`` images (seeds ``seed``, ``seed + 1``, ...) at ``side`` x ``side``
    (``cache``: a ``StepCache``; ``more``: ``prompt_2``, ``negative_prompt_2``, ...,
    ``skip_layer_guidance``, ``timesteps``, ``sigmas``, ``eta``)."""
    seeds = tuple(range(seed, seed + images))
    return JobSpec(
        prompt,
        negative,
        seeds,
        side,
        side,
        steps,
        scheduler,
        guidance,
        image,
        mask,
        strength,
        adapters,
        controls,
        cache,
        clip_skip,
        rescale,
        **more,
    )


def picture(side: int, seed: int = 0) -> Image.Image:
    """An input image: coloured noise."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8))


def hole(side: int) -> Image.Image:
    """An inpainting mask as diffusers takes it: white (repainted) in the middle."""
    mask = np.zeros((side, side), dtype=np.uint8)
    mask[side // 4 : 3 * side // 4, side // 4 : 3 * side // 4] = 255
    return Image.fromarray(mask)


def expected(
    reference: Reference,
    job: JobSpec,
    loras: Sequence[tuple[Path, float]] = (),
    controlnets: Sequence[ControlNetCall] = (),
    lycoris: Sequence[tuple[Path, float]] = (),
):
    """diffusers' own call for the job (with ``loras``: its LoRA files and scales; ``controlnets``:
    its ControlNets' directories, with the job's control images, scales and windows; ``lycoris``:
    LyCORIS files and weights, their deltas merged into the weights)."""
    return reference(
        job.prompt,
        job.seeds[0],
        job.width,
        job.height,
        job.num_inference_steps,
        negative_prompt=job.negative_prompt,
        clip_skip=job.clip_skip,
        num_images_per_prompt=job.images,
        scheduler=job.scheduler,
        guidance_scale=job.guidance_scale,
        guidance_rescale=job.guidance_rescale,
        image=job.image,
        mask=job.mask,
        strength=job.strength,
        loras=loras,
        controlnets=controlnets,
        lycoris=lycoris,
        other_prompts={name: getattr(job, name) for name in OTHER_PROMPTS},
        skip_layer_guidance=job.skip_layer_guidance,
        size_conditioning=job.size_conditioning,
        timesteps=job.timesteps,
        sigmas=job.sigmas,
        eta=job.eta,
        **cache_options(job.cache),
    )


def run(engine: StepEngine, plan: list[tuple[int, JobSpec]]) -> list[Decoded]:
    """Step jobs that join at the given iterations together until all are done (jobs joining at
    one iteration are started together); decode each alone as it finishes. Returns the decoded
    images in plan order."""
    running, finished, iteration = {}, {}, 0
    while len(finished) < len(plan):
        joining = {index: job for index, (joins, job) in enumerate(plan) if joins == iteration}
        running.update(zip(joining, engine.start(list(joining.values())), strict=True))
        engine.step(list(running.values()))
        for index in [index for index, job in running.items() if job.done]:
            job = running.pop(index)
            finished[index] = engine.decode(job.latents, job.spec.width, job.spec.height)
        iteration += 1
    return [finished[index] for index in range(len(plan))]


def run_together_as_diffusers(
    engine: StepEngine, reference: Reference, jobs: list[JobSpec], monkeypatch
) -> tuple[list[Decoded], int]:
    """``jobs`` started together and run to the end, each one's images asserted equal to diffusers'
    call for it; returns them, and how many times the pipeline's ``encode_prompt`` was called."""
    calls = []
    real = engine.pipeline.encode_prompt
    monkeypatch.setattr(
        engine.pipeline, "encode_prompt", lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs)
    )
    decoded, encodings = run(engine, [(0, job) for job in jobs]), len(calls)
    for job, images in zip(jobs, decoded, strict=True):
        assert_same_images(images, expected(reference, job))
    return decoded, encodings


def assert_same_images(actual: Decoded, reference, tolerance: int = TOLERANCE) -> None:
    assert len(actual.images) == len(reference.images)
    for ours, theirs in zip(actual.images, reference.images, strict=True):
        difference = np.abs(np.asarray(ours, dtype=np.int16) - np.asarray(theirs, dtype=np.int16))
        assert difference.max() <= tolerance, f"images differ by up to {difference.max()}"
    assert actual.nsfw_content_detected == reference.nsfw_content_detected


def assert_moved_without(engine: StepEngine, job: JobSpec, decoded: Decoded, **left_out) -> None:
    """A positive control: the job's first image moved against the same job run with the fields
    ``left_out`` (set to their values there)."""
    without = run(engine, [(0, replace(job, **left_out))])[0]
    assert_moved(decoded.images[0], without.images[0], ", ".join(left_out))


def tiny_engine(family: str, **settings) -> StepEngine:
    """An engine over a family's tiny model (``settings``: other handler settings)."""
    return load_engine(
        HandlerSettings.model_validate({"model_path": str(TINY_MODEL_DIRS[family]), **settings}), "/unused"
    )


def engine_with_adapters(family: str, directory: Path, device: str = "auto", **more) -> StepEngine:
    """An engine over a tiny model with a LoRA and a ControlNet for it (``more``: other handler settings)."""
    model_dir = TINY_MODEL_DIRS[family]
    write_lora(model_dir, directory / "loras" / "attention.safetensors", seed=1)
    write_controlnet(model_dir, directory / "controlnets" / "edges", seed=1)
    settings = {
        "device": device,
        "loras": {"dir": str(directory / "loras")},
        "controlnets": {"dir": str(directory / "controlnets")},
    }
    return tiny_engine(family, **settings | more)


def lora_set_jobs(
    engine: StepEngine,
    sets: Sequence[tuple[int, tuple[tuple[str, float], ...]]],
    steps: int,
    scheduler: str = "ddim",
    side: int = 32,
) -> list[tuple[int, JobSpec]]:
    """(joins at iteration, job) for each ``(joins, LoRA set)`` of ``sets``: job ``index`` a
    ``side`` x ``side`` red circle of seed ``index`` with its set's adapters, acquired from the
    engine's LoRA library."""
    return [
        (joins, spec(f"a red circle {index}", index, side=side, steps=steps, scheduler=scheduler, adapters=adapters))
        for index, (joins, lora_set) in enumerate(sets)
        for adapters in [engine.loras.acquire(list(lora_set), in_use=())]
    ]


def assert_each_alone_equals_reference(engine: StepEngine, reference: Reference, jobs: Sequence[JobSpec]) -> None:
    """Each job run alone gives the reference's images for it."""
    for job in jobs:
        (decoded,) = run(engine, [(0, job)])
        assert_same_images(decoded, expected(reference, job))


def stepped_together(engine: StepEngine, jobs: list[DenoiseJob]) -> list[Decoded]:
    """Step started jobs together to the end; each job decoded."""
    while not all(job.done for job in jobs):
        engine.step([job for job in jobs if not job.done])
    return [engine.decode(job.latents, job.spec.width, job.spec.height) for job in jobs]


# Skip-layer guidance over the tiny transformers' middle block at every step after the first.
EVERY_STEP_SKIPPING = SkipLayerGuidance((1,), scale=2.0, start=0.0, stop=1.0)


def jobs_of_every_kind(
    engine: StepEngine,
    scheduler: str,
    side: int = 32,
    steps: int = 4,
    cached: bool = False,
    first_block: bool = False,
    skip_layers: bool = False,
    schedule_settings: bool = False,
    controlnets: bool = True,
) -> list[DenoiseJob]:
    """A plain job (with ``guidance_rescale`` where the family takes it), one with a LoRA, one with
    a LoRA and a ControlNet (where the family takes them), an image-to-image and an inpainting job,
    all stepped together; ``cached``: and, where the engine serves DeepCache, a cached job with the
    LoRA and the ControlNet and one of a branch in another block (their cached steps differ);
    ``first_block``: and, where it serves first-block caching, a job with it and the LoRA (its
    threshold skips every step after the first on the tiny models); ``skip_layers``: and, where it
    serves skip-layer guidance, a job with it and the LoRA, acting at every step after the first
    (before the cached jobs); ``schedule_settings``: and a job of each custom schedule (``timesteps``,
    ``sigmas``) the scheduler takes, one of them from an image, and where it takes ``eta``, an
    inpainting job with it; ``controlnets`` False: no job has a ControlNet."""
    lora = engine.loras.acquire([("attention", 0.8)], in_use=())
    controls = ()
    if controlnets and engine.family.rules.controlnets:
        (edges,) = engine.controlnets.acquire(["edges"], in_use=())
        controls = (ControlSpec(edges, picture(side, 3), 0.9),)
    common = dict(side=side, steps=steps, scheduler=scheduler)
    deep = cached and engine.deep_cache is not None
    cached_specs = [
        *(
            [
                spec("cached", 6, adapters=lora, controls=controls, cache=StepCache(mode="deep", interval=2), **common),
                spec("cached deeper", 7, cache=StepCache(mode="deep", interval=3, branch=4), **common),
            ]
            if deep
            else []
        ),
        *(
            [spec("cached first block", 6, adapters=lora, cache=StepCache(mode="first_block", threshold=0.5), **common)]
            if first_block and engine.first_block is not None
            else []
        ),
    ]
    return engine.start(
        [
            spec("plain", 1, images=2, rescale=0.7 if engine.family.rules.guidance_rescale else 0.0, **common),
            spec("lora", 2, adapters=lora, **common),
            spec("lora and control", 3, adapters=lora, controls=controls, **common),
            spec("image", 4, image=picture(side, 1), strength=0.8, guidance=1.0, **common),
            spec("inpaint", 5, image=picture(side, 2), mask=hole(side), strength=0.9, **common),
            *(
                [spec("skip layers", 8, adapters=lora, skip_layer_guidance=EVERY_STEP_SKIPPING, **common)]
                if skip_layers and engine.rules.transformer_blocks
                else []
            ),
            *(
                spec(f"custom {field}", 9 + index, image=picture(side, 4) if index else None, **schedule, **common)
                for index, (field, schedule) in enumerate(custom_schedules_of(engine.rules, scheduler, steps).items())
                if schedule_settings
            ),
            *(
                [spec("eta", 11, image=picture(side, 2), mask=hole(side), strength=0.9, eta=0.7, **common)]
                if schedule_settings and scheduler in engine.rules.eta_schedulers
                else []
            ),
            *cached_specs,
        ]
    )


def custom_schedules_of(rules: FamilyRules, scheduler: str, steps: int) -> dict[str, dict[str, tuple]]:
    """Per custom schedule field the scheduler takes on this family, a schedule of ``steps`` steps
    (as ``spec`` keywords): timesteps from the noisiest down, sigmas evenly spaced down to Euler's
    final 0 or flow matching's last above it."""
    schedules: dict[str, dict[str, tuple]] = {}
    for field in dict(rules.custom_schedules).get(scheduler, ()):
        final = rules.schedule_steps(field, scheduler, steps) < steps  # sigmas ending with the final one
        if field == "timesteps":
            schedules[field] = {field: tuple((rules.train_timesteps - 1) * (steps - i) // steps for i in range(steps))}
        else:
            top = 10.0 if final else 1.0
            schedules[field] = {field: tuple(top * (steps - i) / steps for i in range(steps + final))}
    return schedules


def compiled_lora_slots(lora_dir: Path) -> dict:
    """``handler`` settings of a worker with its UNet and VAE decoder compiled (compile's default
    targets), two LoRA slots and the shipped ControlNets (the step cache served, as by default),
    over the default model:
    tests/integration/test_compile_cache.py serves it, tests/unit/test_engine_lora_slots.py builds
    it in-process. The same settings and warm-up compile the same graphs, so the second finds them
    in the run's inductor cache. At most 4 images a forward: the warm-up steps 2 to 8 rows, which
    this CPU's convolutions take in one graph of each kind (16 rows or more take another)."""
    return {
        "compile": {"enabled": True},
        "loras": {"dir": str(lora_dir), "max_loaded": 2},
        "controlnets": {"dir": str(CONTROLNET_DIR)},
        "max_images_per_call": 4,
    }


def warmed_engine(model_dir: Path, **settings) -> tuple[StepEngine, float]:
    """The engine of a worker over ``model_dir`` (``settings``: other handler settings), built and
    warmed up as a worker builds and warms it, and the seconds its warm-up took."""
    handler = HandlerSettings.model_validate({"model_path": str(model_dir), **settings})
    service, handler = build_service(handler, "/unused", lambda *_: None)
    return service.engine, service.warm_up(handler.warmup_shapes())
