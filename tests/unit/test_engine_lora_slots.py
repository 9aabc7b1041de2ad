"""LoRA sets in a compiled denoiser (``handler.adapters.lora_slots``, inductor on the CPU), on the
engine of a worker serving the default model with its UNet and VAE decoder compiled and two LoRA
slots, warmed up as the worker warms it (the graphs that tests/integration/test_compile_cache.py's
worker compiled, found in the run's inductor cache): warm-up compiles the whole UNet once plain and
once with LoRA rows, each for every row count from 2, and the VAE decoder for one image and for
more, and after it no job or decode compiles anything, one unguided image (a single row, run as two)
included. Jobs with different sets share forwards and each image equals diffusers'
``load_lora_weights`` + ``set_adapters`` call; loading, evicting and reloading adapters recompiles
nothing; what the slots cannot hold is refused by name, and a full set of slots in use is busy, not
broken. A LyCORIS LoHa on the transformer blocks fits the slots as its exact LoRA; one on
convolutions is refused by name. DeepCache jobs on the compiled UNet (its regions compiled apart)
equal the helper beside uncached jobs; ControlNet jobs (with a LoRA set, in DeepCache's cached
steps) equal diffusers' ControlNet pipeline in the same graphs. SDXL and SD 3:
tests/unit/test_engine_lora_slots_families.py."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from diffusers.models.transformers.transformer_2d import Transformer2DModel
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from bench.reference import ControlNetCall, Reference
from handler.adapters.controlnets import ControlSpec
from handler.adapters.library import Busy, EntryError
from handler.adapters.lora_slots import SlotLinear, compiled_graphs
from handler.config import StepCache
from handler.engine.loading import inductor_cache_counts
from handler.engine.step_engine import StepEngine
from model_making.make_lora import write_lora, write_lycoris
from server.paths import CONTROLNET_DIR, DEFAULT_MODEL_DIR
from tests.harness.engine_runs import (
    assert_same_images,
    compiled_lora_slots,
    expected,
    lora_set_jobs,
    picture,
    run,
    spec,
    warmed_engine,
)
from tests.harness.images import assert_moved

pytestmark = pytest.mark.slow  # compiles the UNet's graphs (or loads them from the run's cache)

MODEL = DEFAULT_MODEL_DIR
SIDE = 64  # the worker's warm-up shape: the default model's native size
LORAS = {  # name: how make_lora writes it
    "attention": dict(seed=1),
    "feed-forward": dict(seed=2, layers=("feed_forward",), text_encoder=False, spread=0.1),  # no text encoder part
    "kohya": dict(seed=4, layers=("attention", "feed_forward"), spread=0.1, kohya=True),
}
SETS = [  # (joins at iteration, LoRA set): two LoRAs in the two slots
    (0, ()),
    (0, (("attention", 0.8),)),
    (0, (("feed-forward", 1.0), ("attention", -0.5))),
    (1, (("attention", -0.3),)),
]


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("loras")
    for name, recipe in LORAS.items():
        write_lora(MODEL, directory / f"{name}.safetensors", **recipe)
    write_lora(MODEL, directory / "conv.safetensors", seed=6, layers=("conv",), text_encoder=False)
    write_lora(MODEL, directory / "wide.safetensors", seed=7, rank=64)  # the slots' rank is 32
    write_lora(MODEL, directory / "text-only.safetensors", seed=8, layers=())
    write_lycoris(MODEL, directory / "loha.safetensors", "loha", seed=9, only="transformer_blocks", text_encoder=False)
    write_lycoris(MODEL, directory / "loha-convs.safetensors", "loha", seed=10)
    return directory


@pytest.fixture(scope="module")
def warmed(lora_dir, record_testsuite_property) -> tuple[StepEngine, int]:
    """The worker's engine after its warm-up, and the graphs compiled by then. What its build and
    warm-up took, the graphs inductor found in its cache or compiled, torch's threads and the load
    average go to the run's JUnit report (``--junitxml``). In a full run the graphs are in the run's
    cache (tests/integration/test_compile_cache.py's worker compiled them): about 35 s here. Where
    pytest's interpreter path differs from the worker's (a symlinked ``.venv``), inductor compiles
    their C++ kernels again, since it keys them by the compile command and its include paths:
    70 to 80 s (tests/conftest.py)."""
    torch._dynamo.reset()  # a worker's process: nothing learnt from other models' compiles
    started, before, load = time.perf_counter(), inductor_cache_counts(), os.getloadavg()[0]
    engine, warm_up_seconds = warmed_engine(MODEL, **compiled_lora_slots(lora_dir))
    seconds = time.perf_counter() - started
    hits, misses = (now - then for now, then in zip(inductor_cache_counts(), before, strict=True))
    record_testsuite_property(
        "lora_slots_build_and_warm_up",
        f"{seconds:.1f} s, warm-up {warm_up_seconds:.1f} s; graphs from the cache {hits}, compiled {misses}; "
        f"torch threads {torch.get_num_threads()}; load average {load:.1f} before, {os.getloadavg()[0]:.1f} after; "
        f"this process's threads {len(os.listdir('/proc/self/task'))}, Python's {sorted(busy_threads())}",
    )
    return engine, compiled_graphs()


def busy_threads() -> list[str]:
    """This process's Python threads other than the main one, each with the CPU seconds it has used
    (a thread left running by an earlier test takes a core from torch's two)."""
    names = {thread.native_id: thread.name for thread in threading.enumerate() if thread is not threading.main_thread()}
    used = []
    for native_id, name in names.items():
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
            used.append(f"{name} {(int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK'):.0f} s")
    return used


@pytest.fixture
def engine(warmed):
    """The warmed engine; the jobs a test steps on it compile nothing."""
    engine, graphs = warmed
    yield engine
    assert compiled_graphs() == graphs, "a job compiled a graph that the worker's warm-up did not"


def jobs_of(engine, sets):
    return lora_set_jobs(engine, sets, steps=3, side=SIDE)


def test_mixed_sets_share_compiled_forwards_and_each_equals_diffusers(engine, lora_dir):
    unet = engine.pipeline.unet  # compiled in place: still the pipeline's model, for diffusers' LoRA loading
    assert type(unet).__name__ == "UNet2DConditionModel" and unet._compiled_call_impl is not None
    assert "compile=default(unet,vae_decoder)" in engine.description
    # warm-up compiled the whole UNet once per kind (plain, with LoRA rows), for every row count from 2
    assert len(_debug_get_cache_entry_list(type(unet).forward.__code__)) == 2
    # and the step cache's regions (attention layers, mid block) once per kind for one row and once
    # for every count from 2: their rows dynamic from the first call, not after a static graph
    for region in (type(unet.mid_block), Transformer2DModel):
        assert len(_debug_get_cache_entry_list(region.forward.__code__)) == 4, region.__name__
    assert engine.loras.slots is not None and all(
        isinstance(module, SlotLinear) for module in engine.loras.slots.layers.values()
    )
    jobs = jobs_of(engine, SETS)
    together = run(engine, jobs)
    reference = Reference(MODEL)
    for (_, job), (_, lora_set), decoded in zip(jobs, SETS, together, strict=True):
        if lora_set:  # alone, a set runs the slots' graph at 2 rows
            (alone,) = run(engine, [(0, job)])
            assert_same_images(decoded, alone)
        files = [(lora_dir / f"{name}.safetensors", weight) for name, weight in lora_set]
        assert_same_images(decoded, expected(reference, job, files))
        if lora_set:  # the slots added each set's deltas: the image is not the one without LoRA
            assert_moved(decoded.images[0], expected(reference, job).images[0], f"LoRA set {lora_set}")


@pytest.mark.parametrize("case", ["uncached", "cached", "beside a cached job"])
def test_a_single_unguided_image_compiles_nothing_and_equals_diffusers(engine, lora_dir, case):
    """The worker's defaults are guided, so its warm-up compiled two rows an image and up: one
    unguided image (one row) runs as two, alone and with a LoRA, and compiles nothing. A forward with
    a step cache is not padded: warm-up compiled the cache's regions at one row too, which a cached
    single image runs, and an uncached one beside a cached job at its cached steps (the deep blocks
    on its row alone); each equals diffusers' call (cached: under the DeepCache helper)."""
    deep = StepCache(mode="deep", interval=2)
    reference = Reference(MODEL)
    for lora_set in ((), (("attention", 0.8),)):
        adapters = engine.loras.acquire(list(lora_set), in_use=())
        job = spec("a red circle", 5, side=SIDE, steps=3, guidance=0.0, adapters=adapters)
        jobs = [(0, replace(job, cache=deep) if case == "cached" else job)]
        if case == "beside a cached job":
            jobs.append((0, spec("a blue square", 6, side=SIDE, steps=3, cache=deep)))
        files = [(lora_dir / f"{name}.safetensors", weight) for name, weight in lora_set]
        for (_, ran), decoded, ran_files in zip(jobs, run(engine, jobs), [files, []], strict=False):
            assert_same_images(decoded, expected(reference, ran, ran_files))


def test_a_new_adapter_and_an_eviction_recompile_nothing(engine, lora_dir):
    run(engine, jobs_of(engine, [(0, (("attention", 0.5),)), (0, (("feed-forward", 1.0),))]))  # both slots in use
    late = [(0, (("kohya", 0.9), ("attention", 0.3))), (0, ())]  # a third LoRA (kohya's keys): a slot evicted
    jobs = jobs_of(engine, late)
    decoded = run(engine, jobs)
    files = [(lora_dir / "kohya.safetensors", 0.9), (lora_dir / "attention.safetensors", 0.3)]
    reference = Reference(MODEL)
    assert_same_images(decoded[0], expected(reference, jobs[0][1], files))
    assert_moved(decoded[0].images[0], expected(reference, jobs[0][1]).images[0], "the late set")


@pytest.mark.parametrize("images", [1, 2, 3, 5])
def test_decoding_any_count_of_images_compiles_nothing_and_equals_the_eager_decode(engine, images):
    """A step decodes the images of every job finishing in it in one call: warm-up decoded one image
    and two, which compiled the VAE decoder's graph of one image and its graph of two or more."""
    vae, graphs = engine.pipeline.vae, compiled_graphs()
    assert "compile=default(unet,vae_decoder)" in engine.description
    with torch.inference_mode():  # as the engine's latents are made
        latents = torch.randn(images, *engine.latent_shape(SIDE, SIDE), generator=torch.Generator().manual_seed(images))
        compiled = vae.decode(latents, return_dict=False)[0]
        eager = type(vae).decode(vae, latents, return_dict=False)[0]
    assert compiled_graphs() == graphs, f"decoding {images} images compiled a graph"
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("conv", "is not served with a compiled denoiser"),
        ("wide", "rank 64"),
        ("loha-convs", "is not served with a compiled denoiser"),
    ],
)
def test_what_the_slots_cannot_hold_is_refused_by_name(engine, name, says):
    with pytest.raises(EntryError, match=says) as refused:
        engine.loras.acquire([(name, 1.0)], in_use=())
    assert refused.value.rule == "lora_unloadable"
    assert not hasattr(engine.family.denoiser, "peft_config")  # PEFT's layers are out again
    run(engine, jobs_of(engine, [(0, (("attention", 0.5),))]))  # the denoiser's own modules are back


def test_a_loha_in_the_slots_beside_a_lora_equals_its_delta_merged(engine, lora_dir):
    sets = [(0, (("loha", 0.8),)), (0, (("attention", 0.5),))]
    jobs = jobs_of(engine, sets)
    decoded = run(engine, jobs)
    reference = Reference(MODEL)
    loha, attention = lora_dir / "loha.safetensors", lora_dir / "attention.safetensors"
    assert_same_images(decoded[0], expected(reference, jobs[0][1], lycoris=[(loha, 0.8)]))
    assert_same_images(decoded[1], expected(reference, jobs[1][1], [(attention, 0.5)]))
    assert_moved(decoded[0].images[0], expected(reference, jobs[0][1]).images[0], "the LoHa")


def test_cached_jobs_on_the_compiled_unet_equal_the_helper_beside_uncached_ones(engine, lora_dir):
    """DeepCache rows (three intervals and branches, one with a LoRA set in the slots, one of two
    images) and uncached rows share the compiled UNet's forwards, each equal to diffusers' call
    under the DeepCache helper, all in the graphs the warm-up compiled."""
    assert "step_cache=deep(compiled regions)" in engine.description
    sets = [(0, (("attention", 0.8),)), (0, ()), (1, ()), (1, (("attention", 0.5),))]
    caches = [StepCache(mode="deep", interval=2), StepCache(mode="deep", interval=3, branch=1), None, None]
    jobs = [
        (joins, replace(job, cache=cache)) for (joins, job), cache in zip(jobs_of(engine, sets), caches, strict=True)
    ]
    jobs.append((2, replace(jobs[1][1], seeds=(7, 8), cache=StepCache(mode="deep", interval=4, branch=2))))
    reference = Reference(MODEL)
    for (_, job), (_, lora_set), image in zip(jobs, [*sets, (2, ())], run(engine, jobs), strict=True):
        files = [(lora_dir / f"{name}.safetensors", weight) for name, weight in lora_set]
        assert_same_images(image, expected(reference, job, files))


def test_controlnet_jobs_on_the_compiled_unet_equal_diffusers_and_compile_nothing(engine, lora_dir):
    """A compiled UNet serving ControlNets takes residuals in every forward (zeros where no row uses
    a ControlNet), so the graphs warm-up compiled serve ControlNet jobs beside a plain job: one with
    a LoRA set in the slots, one in a window (the whole-model graph, three forwards), then one in
    DeepCache's cached steps (its regions), each equal to diffusers' ControlNet pipeline (the cached
    one under the DeepCache helper)."""
    (mask,) = engine.controlnets.acquire(["shapes-mask"], in_use=())
    maps = [picture(SIDE, seed) for seed in (1, 2, 3)]
    lora = engine.loras.acquire([("attention", 0.8)], in_use=())
    common = dict(side=SIDE, steps=4)
    deep = StepCache(mode="deep", interval=2)
    jobs = [
        (0, spec("a red circle", 1, adapters=lora, controls=(ControlSpec(mask, maps[0], 0.9),), **common)),
        (0, spec("a blue square", 2, **common)),
        (1, spec("a green triangle", 3, controls=(ControlSpec(mask, maps[1], 1.2, 0.25, 0.75),), **common)),
        (3, spec("a red square", 4, controls=(ControlSpec(mask, maps[2]),), cache=deep, **common)),
    ]
    reference = Reference(MODEL)
    files = [[(lora_dir / "attention.safetensors", 0.8)], [], [], []]
    for (_, job), decoded, job_files in zip(jobs, run(engine, jobs), files, strict=True):
        calls = [ControlNetCall(CONTROLNET_DIR / "shapes-mask", c.image, c.scale, c.start, c.end) for c in job.controls]
        assert_same_images(decoded, expected(reference, job, job_files, calls))
        if calls:
            assert_moved(decoded.images[0], expected(reference, job, job_files).images[0], "the ControlNet")


def test_every_slot_in_use_is_busy(engine):
    held = {adapter for adapter, _ in engine.loras.acquire([("attention", 1.0), ("feed-forward", 1.0)], in_use=())}
    with pytest.raises(Busy, match="all 2 LoRA slots"):
        engine.loras.acquire([("kohya", 1.0)], in_use=held)
    assert engine.loras.slots.free == 0


def test_a_lora_of_the_text_encoders_only_takes_no_slot_so_full_slots_do_not_refuse_it(engine, lora_dir):
    held = {adapter for adapter, _ in engine.loras.acquire([("attention", 1.0), ("feed-forward", 1.0)], in_use=())}
    assert engine.loras.slots.free == 0
    adapters = engine.loras.acquire([("text-only", 1.0)], in_use=held)
    assert engine.loras.slots.free == 0 and not engine.loras.slots.needs_slot(adapters[0][0])
    job = spec("a red circle", 3, side=SIDE, steps=3, adapters=adapters)
    attention = held_attention(engine, held | {adapters[0][0]})
    beside = spec("a blue square", 4, side=SIDE, steps=3, adapters=((attention, 1.0),))
    reference = Reference(MODEL)
    decoded, _ = run(engine, [(0, job), (0, beside)])  # beside a slot's rows: the slots' graph
    assert_same_images(decoded, expected(reference, job, [(lora_dir / "text-only.safetensors", 1.0)]))
    assert_moved(decoded.images[0], expected(reference, job).images[0], "the text encoders' LoRA")


def held_attention(engine, held: set[str]) -> str:
    """The id of the loaded ``attention`` LoRA, one of ``held``."""
    (adapter,) = [adapter for adapter, _ in engine.loras.acquire([("attention", 1.0)], in_use=held)]
    return adapter
