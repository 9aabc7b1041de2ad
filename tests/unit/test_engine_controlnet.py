"""Jobs with different ControlNets (or none) in one denoiser forward, per family (tiny random-weight
SD 1.x, SD 2.x, SDXL, SD 3 and SD 3.5 with random ControlNets): one ControlNet, two at once, a
window, an input image (UNet families), a LoRA, plain jobs beside them, joining mid-flight; each
image equals the same job alone and diffusers' ControlNet pipelines (a DeepCache job: under the
DeepCache helper); each ControlNet runs once per step over its rows, and only in its window. The
library refuses what it cannot serve before the forward. A ControlNet written as one file (A1111's
LDM keys, or diffusers' keys) serves its directory's images; another family's file, a LoRA file and
a truncated one are refused by name. SD 3.x: ControlNets of two kinds and depths in one forward
with skip-layer guidance and first-block caching beside them."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import SD3ControlNetModel
from diffusers.models.downsampling import Downsample2D
from safetensors.torch import load_file, save_file

from bench.reference import ControlNetCall, Reference
from handler.adapters.controlnets import ControlSpec
from handler.adapters.library import EntryError
from handler.config import HandlerSettings, SizeConditioning, SkipLayerGuidance, StepCache
from handler.engine.loading import load_engine
from handler.engine.step_engine import StepEngine
from handler.families.sd import _downsampled
from model_making.make_controlnet import write_controlnet
from model_making.make_lora import write_lora
from model_making.make_tiny_model import build_sd3_pipeline
from model_making.single_file import write_controlnet_file
from server.paths import TINY_MODEL_DIRS
from tests.harness.engine_runs import (
    TOLERANCE,
    assert_same_images,
    engine_with_adapters,
    expected,
    picture,
    run,
    spec,
)

SCHEDULERS = {"sd1": "ddim", "sd2": "euler_a", "sdxl": "euler"}
SIDE = 32
STEPS = 4


@pytest.fixture(scope="module", params=list(SCHEDULERS))
def family_engine(request, tmp_path_factory):
    """An engine over a tiny model with two random ControlNets and a LoRA for it."""
    family = request.param
    engine, directory, loras = adapters_engine(family, tmp_path_factory.mktemp(family))
    write_controlnet(TINY_MODEL_DIRS[family], directory / "depth", seed=2)
    return family, engine, directory, loras, Reference(TINY_MODEL_DIRS[family])


def adapters_engine(family: str, tmp: Path) -> tuple[StepEngine, Path, Path]:
    """``engine_with_adapters``' engine (ControlNet "edges", LoRA "attention"), its ControlNet
    directory (ControlNets written there later are served too) and its LoRA directory."""
    return engine_with_adapters(family, tmp), tmp / "controlnets", tmp / "loras"


def test_jobs_with_other_controlnets_share_forwards_and_each_equals_diffusers(family_engine):
    family, engine, directory, loras, reference = family_engine
    edges, depth = engine.controlnets.acquire(["edges", "depth"], in_use=())
    maps = [picture(SIDE, seed) for seed in range(3)]
    scheduler = SCHEDULERS[family]
    plans = [  # (joins at iteration, controls, input image, LoRA)
        (0, (), None, False),
        (0, (ControlSpec(edges, maps[0]),), None, False),
        (0, (ControlSpec(edges, maps[1], 0.7), ControlSpec(depth, maps[2], 1.3, 0.25, 0.75)), None, False),
        (1, (ControlSpec(depth, maps[0], 0.9, 0.0, 0.5),), picture(SIDE, 9), False),
        (1, (ControlSpec(edges, maps[2], 1.0),), None, True),
    ]
    # SDXL's sizes as its ControlNet text-to-image and img2img pipelines read them
    sizes = {
        2: SizeConditioning((96, 96), negative_original_size=(32, 32), negative_target_size=(48, 48)),
        3: SizeConditioning(crops_coords_top_left=(8, 8), negative_original_size=(16, 16)),
    }
    jobs = []
    for index, (joins, controls, image, lora) in enumerate(plans):
        adapters = engine.loras.acquire([("attention", 0.8)], in_use=()) if lora else ()
        job = spec(
            f"a red circle {index}",
            index,
            images=2 if index == 1 else 1,
            side=SIDE,
            steps=STEPS,
            scheduler=scheduler,
            image=image,
            strength=0.75 if image is not None else 1.0,
            adapters=adapters,
            controls=controls,
            size_conditioning=sizes.get(index) if family == "sdxl" else None,
        )
        jobs.append((joins, job))
    together = run(engine, jobs)
    paths = {edges: directory / "edges", depth: directory / "depth"}
    for (_, job), (_, controls, _, lora), decoded in zip(jobs, plans, together, strict=True):
        (alone,) = run(engine, [(0, job)])
        assert_same_images(decoded, alone)
        calls = [ControlNetCall(paths[c.net], c.image, c.scale, c.start, c.end) for c in controls]
        files = [(loras / "attention.safetensors", 0.8)] if lora else []
        theirs = expected(reference, job, files, calls)
        assert_same_images(decoded, theirs)
        if controls:  # and the ControlNets changed the image
            plain = np.asarray(expected(reference, job, files).images[0], dtype=np.int16)
            assert np.abs(np.asarray(theirs.images[0], dtype=np.int16) - plain).max() > 8


def test_a_deepcache_job_with_controlnets_equals_the_helper_on_the_controlnet_pipeline(family_engine):
    """DeepCache (interval 2: steps 1 and 3 cached) with a LoRA and two ControlNets, one at every
    step, one acting only at step 1, beside an uncached job with the first in the same forwards:
    each ControlNet's residuals reach the shallow branch at a cached step, as under the ``DeepCache``
    package's helper on diffusers' ControlNet pipeline (the net of step 1 alone changes the image)."""
    family, engine, directory, loras, reference = family_engine
    edges, depth = engine.controlnets.acquire(["edges", "depth"], in_use=())
    lora = engine.loras.acquire([("attention", 0.8)], in_use=())
    common = dict(side=SIDE, steps=STEPS, scheduler=SCHEDULERS[family])
    maps = [picture(SIDE, seed) for seed in (4, 5)]
    controls = (ControlSpec(edges, maps[0], 0.9), ControlSpec(depth, maps[1], 1.5, 0.25, 0.5))
    cached = spec(
        "a red circle", 5, controls=controls, adapters=lora, cache=StepCache(mode="deep", interval=2), **common
    )
    beside = spec("a blue square", 6, controls=controls[:1], **common)
    together = run(engine, [(0, cached), (0, beside)])
    calls = [
        ControlNetCall(directory / name, c.image, c.scale, c.start, c.end)
        for name, c in zip(("edges", "depth"), controls, strict=True)
    ]
    files = [(loras / "attention.safetensors", 0.8)]
    helper = expected(reference, cached, files, calls)
    assert_same_images(together[0], helper)
    assert_same_images(together[1], expected(reference, beside, [], calls[:1]))
    helper_pixels = np.asarray(helper.images[0], np.int16)
    for other, nets in ((replace(cached, cache=None), calls), (replace(cached, controls=controls[:1]), calls[:1])):
        theirs = np.asarray(expected(reference, other, files, nets).images[0], np.int16)
        assert np.abs(helper_pixels - theirs).max() > 4 * TOLERANCE


def test_each_controlnet_runs_once_per_step_over_its_rows_and_only_in_its_window(family_engine):
    family, engine, *_ = family_engine
    edges, depth = engine.controlnets.acquire(["edges", "depth"], in_use=())
    control = picture(SIDE)
    jobs = engine.start(
        [
            spec("a", 1, side=SIDE, steps=4, scheduler=SCHEDULERS[family], controls=(ControlSpec(edges, control),)),
            spec("b", 2, side=SIDE, steps=4, scheduler=SCHEDULERS[family], controls=(ControlSpec(edges, control),)),
            spec(
                "c",
                3,
                side=SIDE,
                steps=4,
                scheduler=SCHEDULERS[family],
                controls=(ControlSpec(depth, control, 1.0, 0.5, 1.0),),
            ),
            spec("d", 4, side=SIDE, steps=4, scheduler=SCHEDULERS[family]),
        ]
    )
    calls = []
    for net_id in (edges, depth):
        net = engine.controlnets._nets[net_id]
        net.register_forward_hook(
            lambda module, args, kwargs, out, net_id=net_id: calls.append((net_id, args[0].shape[0])), with_kwargs=True
        )
    forwards = [engine.step(jobs) for _ in range(4)]
    # both ControlNets act in the last two steps (depth from half-way), each over its own rows (2 per guided job)
    assert forwards == [1, 1, 2, 2]
    assert calls[:2] == [(edges, 4), (edges, 4)]
    assert sorted(calls[2:4]) == sorted([(edges, 4), (depth, 2)])


def test_a_compiled_unets_zero_residuals_fit_every_block_and_change_no_image(family_engine, monkeypatch):
    """``every_forward`` (a compiled UNet serving ControlNets: one graph for forwards with and
    without them): a forward no row of which uses a ControlNet takes zeros shaped as a ControlNet's
    residuals, also where the downsamplers round an odd side up (72x56: 9x7 latents), and every
    image stays the same bit for bit, a ControlNet job's beside them too."""
    family, engine, *_ = family_engine
    (edges,) = engine.controlnets.acquire(["edges"], in_use=())
    plain = replace(spec("a blue square", 3, steps=2, scheduler=SCHEDULERS[family]), width=72, height=56)
    controlled = replace(plain, prompt="a red circle", controls=(ControlSpec(edges, picture(72)),))
    residuals_taken = []  # per forward, whether the UNet took residuals
    forward = engine.family.forward
    monkeypatch.setattr(
        engine.family, "forward", lambda *args: residuals_taken.append(args[3] is not None) or forward(*args)
    )

    def images(every_forward: bool) -> list[np.ndarray]:
        residuals_taken.clear()
        monkeypatch.setattr(engine.controlnets, "every_forward", every_forward)
        return [np.asarray(image) for decoded in run(engine, [(0, plain), (1, controlled)]) for image in decoded.images]

    assert all(np.array_equal(a, b) for a, b in zip(images(True), images(False), strict=True))
    assert residuals_taken == [False, True, True]  # the plain job's first forward took none
    images(True)
    assert residuals_taken == [True, True, True]
    net = engine.controlnets._nets[edges]
    job = engine.start([controlled])[0]
    latents = torch.cat([job.latents] * 2)
    residuals = engine.family.control_forward(
        net, latents, job.timesteps[:1].expand(2), job.conditioning, torch.zeros(2, 3, 56, 72, dtype=engine.dtype)
    )
    zeros = engine.family.control_zeros(latents, engine.dtype)
    assert [sample.shape for sample in zeros] == [sample.shape for sample in residuals]
    assert not any(sample.any() for sample in zeros)


@pytest.mark.parametrize(("use_conv", "padding"), [(True, 1), (True, 0), (False, 1)])
def test_zero_residuals_take_the_sides_a_downsampler_makes(use_conv, padding):
    """Odd sides: padding 1 rounds up, padding 0 (one pixel padded on the far side) and pooling down."""
    sampler = Downsample2D(4, use_conv=use_conv, padding=padding)
    for side in range(2, 12):
        assert _downsampled(sampler, side) == sampler(torch.zeros(1, 4, side, side)).shape[-1]


def test_the_library_refuses_bad_names_pickles_and_other_families_controlnets(family_engine, tmp_path):
    family, engine, directory, *_ = family_engine
    other = "sd1" if family == "sdxl" else "sdxl"
    write_controlnet(TINY_MODEL_DIRS[other], directory / "other-family", seed=3)
    pickled = directory / "pickled"
    shutil.copytree(directory / "edges", pickled, dirs_exist_ok=True)
    for weights in pickled.glob("*.safetensors"):
        weights.unlink()
    torch.save({"weight": torch.zeros(1)}, pickled / "diffusion_pytorch_model.bin")
    outside = tmp_path / "outside"
    shutil.copytree(directory / "edges", outside)
    (directory / "escape").symlink_to(outside)
    cases = {
        "../edges": "controlnet_name",
        "/etc": "controlnet_name",
        "a/b": "controlnet_name",
        "missing": "unknown_controlnet",
        "escape": "unknown_controlnet",
        "pickled": "controlnet_unloadable",
        "other-family": "controlnet_unloadable",
    }
    try:
        for name, rule in cases.items():
            with pytest.raises(EntryError) as refused:
                engine.controlnets.acquire([name], in_use=())
            assert refused.value.rule == rule, (name, str(refused.value))
    finally:
        for name in ("other-family", "pickled"):
            shutil.rmtree(directory / name)
        (directory / "escape").unlink()
    names = [item.name for item in engine.controlnets.available()]
    assert names == ["depth", "edges"]


def test_single_file_controlnets_equal_their_directory_and_misfits_are_refused(family_engine, tmp_path):
    family, engine, directory, loras, _ = family_engine
    other = "sd1" if family == "sdxl" else "sdxl"
    files = {
        "edges-a1111": write_controlnet_file(directory / "edges", directory / "edges-a1111.safetensors"),
        "edges-diffusers": write_controlnet_file(
            directory / "edges", directory / "edges-diffusers.safetensors", ldm=False
        ),
    }
    other_dir = write_controlnet(TINY_MODEL_DIRS[other], tmp_path / "other", seed=3)
    misfits = {
        "other-family": (
            write_controlnet_file(other_dir, directory / "other-family.safetensors"),
            "not fit|is missing|has shape",
        ),
        "a-lora": (shutil.copy(loras / "attention.safetensors", directory / "a-lora.safetensors"), "not a ControlNet"),
        "truncated": (directory / "truncated.safetensors", "not a readable safetensors file"),
    }
    misfits["truncated"][0].write_bytes(files["edges-a1111"].read_bytes()[:4096])
    extra = load_file(files["edges-diffusers"]) | {"task_embedding": torch.zeros(4, 8)}  # as ControlNet-Union has
    save_file(extra, directory / "union.safetensors")
    misfits["union"] = (directory / "union.safetensors", "no ControlNet of this model has")
    shutil.copy(files["edges-a1111"], directory / "shuffle.safetensors")
    (directory / "shuffle.yaml").write_text(
        "model:\n  params:\n    control_stage_config:\n      params:\n        global_average_pooling: True\n"
    )
    misfits["shuffle"] = (directory / "shuffle.safetensors", "global-pooling")
    try:
        (edges,) = engine.controlnets.acquire(["edges"], in_use=())
        control_map = picture(SIDE, 5)
        job = spec("a red circle", 3, side=SIDE, steps=STEPS, scheduler=SCHEDULERS[family])
        (from_directory,) = run(engine, [(0, replace(job, controls=(ControlSpec(edges, control_map),)))])
        for name in files:
            (net,) = engine.controlnets.acquire([name], in_use=())
            (from_file,) = run(engine, [(0, replace(job, controls=(ControlSpec(net, control_map),)))])
            assert_same_images(from_file, from_directory)
        for name, (_, says) in misfits.items():
            with pytest.raises(EntryError, match=says) as refused:
                engine.controlnets.acquire([name], in_use=())
            assert refused.value.rule == "controlnet_unloadable" and name in str(refused.value)
    finally:
        for path in [*files.values(), *(path for path, _ in misfits.values()), directory / "shuffle.yaml"]:
            path.unlink()


# SD 3.x: StableDiffusion3ControlNetPipeline, each ControlNet's residuals added after the transformer's blocks.


@pytest.fixture(scope="module", params=["sd3", "sd35"])
def sd3_engine(request, tmp_path_factory):
    """An engine over a tiny SD 3.x model with three random ControlNets of two kinds and depths
    (InstantX's of 2 and 1 blocks, SD 3.5 Large's of 2) and a LoRA for it."""
    family = request.param
    engine, directory, loras = adapters_engine(family, tmp_path_factory.mktemp(family))
    write_controlnet(TINY_MODEL_DIRS[family], directory / "depth", seed=2, layers=1)
    write_controlnet(TINY_MODEL_DIRS[family], directory / "large", seed=3, layers=2, large=True)
    return engine, directory, loras, Reference(TINY_MODEL_DIRS[family])


def test_sd3_jobs_with_other_controlnets_share_forwards_and_each_equals_diffusers(sd3_engine):
    """One ControlNet on two images, two of different depths at once with windows and scales, SD 3.5
    Large's kind, one with a LoRA, joining mid-flight, beside a plain job and jobs with skip-layer
    guidance and first-block caching in the same forwards: each equals the same job alone and
    ``StableDiffusion3ControlNetPipeline`` (its control latents drawn after ``torch.manual_seed(seed)``),
    and the ControlNets changed each image."""
    engine, directory, loras, reference = sd3_engine
    edges, depth, large = engine.controlnets.acquire(["edges", "depth", "large"], in_use=())
    maps = [picture(SIDE, seed) for seed in range(3)]
    common = dict(side=SIDE, steps=STEPS, scheduler="flow_match_euler")
    lora = engine.loras.acquire([("attention", 0.8)], in_use=())
    plans = [  # (joins at iteration, job)
        (0, spec("plain", 0, **common)),
        (0, spec("one net", 1, images=2, controls=(ControlSpec(edges, maps[0]),), **common)),
        (
            0,
            spec(
                "two nets",
                2,
                controls=(ControlSpec(edges, maps[1], 0.7), ControlSpec(depth, maps[2], 1.3, 0.25, 0.75)),
                **common,
            ),
        ),
        (1, spec("large", 3, controls=(ControlSpec(large, maps[0], 1.1, 0.0, 0.5),), **common)),
        (1, spec("lora", 4, adapters=lora, controls=(ControlSpec(depth, maps[1], 0.9),), **common)),
        (0, spec("skips", 5, skip_layer_guidance=SkipLayerGuidance((1,), scale=2.0, start=0.0, stop=1.0), **common)),
        (0, spec("cached", 6, cache=StepCache(mode="first_block", threshold=0.5), **common)),
    ]
    together = run(engine, plans)
    paths = {edges: directory / "edges", depth: directory / "depth", large: directory / "large"}
    for (_, job), decoded in zip(plans, together, strict=True):
        (alone,) = run(engine, [(0, job)])
        assert_same_images(decoded, alone)
        calls = [ControlNetCall(paths[c.net], c.image, c.scale, c.start, c.end) for c in job.controls]
        files = [(loras / "attention.safetensors", 0.8)] if job.adapters else []
        theirs = expected(reference, job, files, calls)
        assert_same_images(decoded, theirs)
        if job.controls:
            plain = np.asarray(expected(reference, job, files).images[0], dtype=np.int16)
            assert np.abs(np.asarray(theirs.images[0], dtype=np.int16) - plain).max() > 8


def test_sd3_controlnets_run_once_per_step_and_their_forwards_are_the_transformers_own(sd3_engine, monkeypatch):
    """Each ControlNet runs once per step over its rows; a forward with ControlNet rows passes the
    transformer no residuals (its block wrappers add them) and is not padded."""
    engine, *_ = sd3_engine
    edges, depth = engine.controlnets.acquire(["edges", "depth"], in_use=())
    control = picture(SIDE)
    common = dict(side=SIDE, steps=4, scheduler="flow_match_euler")
    jobs = engine.start(
        [
            spec("a", 1, controls=(ControlSpec(edges, control),), **common),
            spec("b", 2, controls=(ControlSpec(depth, control, 1.0, 0.5, 1.0),), **common),
            spec("c", 3, **common),
        ]
    )
    padded = replace(engine, row_counts=(8,))
    assert padded.padding(jobs) == 0
    passed = []
    forward = engine.family.forward
    monkeypatch.setattr(engine.family, "forward", lambda *args: passed.append(args[3]) or forward(*args))
    assert [padded.step(jobs) for _ in range(4)] == [1, 1, 2, 2]
    assert passed == [None] * 4


def test_the_sd3_library_refuses_misfits_by_name(sd3_engine, tmp_path):
    """A UNet family's ControlNet, an inpainting one, one of another width, and a single file."""
    engine, directory, *_ = sd3_engine
    config = json.loads((directory / "edges" / "config.json").read_text())
    write_controlnet(TINY_MODEL_DIRS["sd1"], directory / "unet-family", seed=3)
    for name, change in (("inpainting", {"extra_conditioning_channels": 1}), ("wider", {"attention_head_dim": 16})):
        keys = {key: value for key, value in {**config, **change}.items() if not key.startswith("_")}
        SD3ControlNetModel(**keys).save_pretrained(str(directory / name), safe_serialization=True)
    shutil.copy(next((directory / "edges").glob("*.safetensors")), directory / "a-file.safetensors")
    cases = {
        "unet-family": "declares class ControlNetModel; this SD 3.x model takes class SD3ControlNetModel",
        "inpainting": "inpainting ControlNets",
        "wider": "width 64 \\(transformer: 32\\)",
        "a-file": "single-file SD 3.x ControlNets are not served",
    }
    try:
        for name, says in cases.items():
            with pytest.raises(EntryError, match=says) as refused:
                engine.controlnets.acquire([name], in_use=())
            assert refused.value.rule == "controlnet_unloadable" and name in str(refused.value)
        listed = [entry.name for entry in engine.controlnets.available()]
        assert "a-file" not in listed and "edges" in listed, "a model list offers no file it refuses"
    finally:
        for name in ("unet-family", "inpainting", "wider"):
            shutil.rmtree(directory / name)
        (directory / "a-file.safetensors").unlink()


def test_an_sd35_large_controlnet_takes_the_transformers_position_embedding_under_a_lora(sd3_engine):
    """A ControlNet without a position embedding of its own loads after a LoRA wrapped the
    transformer's (its convolution): it takes the base weights, as diffusers' pipeline would."""
    engine, directory, loras, reference = sd3_engine
    conv = {"layers": ("conv", "feed_forward"), "spread": 0.1, "text_encoder": False}
    write_lora(reference.model_dir, loras / "conv.safetensors", seed=4, **conv)
    engine.loras.acquire([("conv", 1.0)], in_use=())
    proj = engine.pipeline.transformer.pos_embed.proj
    assert hasattr(proj, "base_layer"), "the LoRA wraps the position embedding's convolution"
    shutil.copytree(directory / "large", directory / "large-again")
    try:
        (net_id,) = engine.controlnets.acquire(["large-again"], in_use=())
        taken = engine.controlnets.net(net_id).pos_embed.proj.weight
        assert torch.equal(taken, proj.base_layer.weight.to(taken.dtype))
    finally:
        shutil.rmtree(directory / "large-again")


def test_sd3_controlnets_of_other_depths_spread_over_the_blocks_as_diffusers_does(tmp_path):
    """On a 6-block transformer a ControlNet of 3 blocks adds each residual after 2 blocks, one of
    2 after 3, and a request with both sums them pairwise (``SD3MultiControlNetModel``: the deeper
    one's last residual unused): each, in one forward, equals ``StableDiffusion3ControlNetPipeline``."""
    model_dir = tmp_path / "six-blocks"
    build_sd3_pipeline(0, num_layers=6).save_pretrained(str(model_dir), safe_serialization=True)
    directory = tmp_path / "controlnets"
    write_controlnet(model_dir, directory / "three", seed=1, layers=3)
    write_controlnet(model_dir, directory / "two", seed=2, layers=2)
    settings = {"model_path": str(model_dir), "controlnets": {"dir": str(directory)}}
    engine = load_engine(HandlerSettings.model_validate(settings), "/unused")
    three, two = engine.controlnets.acquire(["three", "two"], in_use=())
    maps = [picture(SIDE, seed) for seed in range(2)]
    common = dict(side=SIDE, steps=3, scheduler="flow_match_euler")
    plans = [
        (0, spec("three", 1, controls=(ControlSpec(three, maps[0]),), **common)),
        (0, spec("two", 2, controls=(ControlSpec(two, maps[1]),), **common)),
        (0, spec("both", 3, controls=(ControlSpec(three, maps[0]), ControlSpec(two, maps[1], 0.8)), **common)),
    ]
    assert [control.slots for control in engine.start([plans[2][1]])[0].controls] == [(0, 0, 0, 1, 1, 1)] * 2
    reference = Reference(model_dir)
    paths = {three: directory / "three", two: directory / "two"}
    for (_, job), decoded in zip(plans, run(engine, plans), strict=True):
        calls = [ControlNetCall(paths[c.net], c.image, c.scale, c.start, c.end) for c in job.controls]
        assert_same_images(decoded, expected(reference, job, (), calls))
