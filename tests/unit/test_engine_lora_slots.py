"""LoRA sets in a compiled denoiser (``handler.adapters.lora_slots``, tiny SD 1.x, inductor on the CPU): jobs
with different sets share forwards and each image equals diffusers' ``load_lora_weights`` +
``set_adapters`` call; loading, evicting and reloading adapters recompiles nothing; what the slots
cannot hold is refused by name, and a full set of slots in use is busy, not broken. A LyCORIS LoHa
on the transformer blocks fits the slots as its exact LoRA; one on convolutions is refused by name.
Step caches on a compiled denoiser (its regions compiled apart) equal the references beside
uncached jobs, and compile a bounded few graphs."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from torch._dynamo.utils import counters

from bench.reference import Reference
from handler.adapters.library import Busy, EntryError
from handler.adapters.lora_slots import SlotLinear, compiled_graphs
from handler.config import HandlerSettings, StepCache
from handler.engine.loading import load_engine
from model_making.make_lora import write_lora, write_lycoris
from server.paths import TINY_MODEL_DIRS
from tests.harness.engine_runs import assert_same_images, expected, lora_set_jobs, run, spec
from tests.harness.images import assert_moved

pytestmark = pytest.mark.slow  # compiles the tiny UNet (about a minute here)

MODEL = TINY_MODEL_DIRS["sd1"]
LORAS = {  # name: how make_lora writes it
    "attention": dict(seed=1),
    "feed-forward": dict(seed=2, layers=("feed_forward",), text_encoder=False, spread=0.1),  # no text encoder part
    "kohya": dict(seed=4, layers=("attention", "feed_forward"), spread=0.1, kohya=True),
    "late": dict(seed=5),
}
SETS = [  # (joins at iteration, LoRA set)
    (0, ()),
    (0, (("attention", 0.8),)),
    (0, (("feed-forward", 1.0), ("attention", -0.5))),
    (1, (("kohya", 0.6),)),
]


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("loras")
    for name, recipe in LORAS.items():
        write_lora(MODEL, directory / f"{name}.safetensors", **recipe)
    write_lora(MODEL, directory / "conv.safetensors", seed=6, layers=("conv",), text_encoder=False)
    write_lora(MODEL, directory / "wide.safetensors", seed=7, rank=16)
    write_lora(MODEL, directory / "text-only.safetensors", seed=8, layers=())
    write_lycoris(MODEL, directory / "loha.safetensors", "loha", seed=9, only="transformer_blocks", text_encoder=False)
    write_lycoris(MODEL, directory / "loha-convs.safetensors", "loha", seed=10)
    return directory


@pytest.fixture(scope="module")
def engine(lora_dir):
    settings = {
        "model_path": str(MODEL),
        "compile": {"enabled": True, "targets": ["unet"]},
        "loras": {"dir": str(lora_dir), "max_loaded": 3, "slot_rank": 8},
    }
    return load_engine(HandlerSettings.model_validate(settings), "/unused")


def jobs_of(engine, sets):
    return lora_set_jobs(engine, sets, steps=3)


def test_mixed_sets_share_compiled_forwards_and_each_equals_diffusers(engine, lora_dir):
    unet = engine.pipeline.unet  # compiled in place: still the pipeline's model, for diffusers' LoRA loading
    assert type(unet).__name__ == "UNet2DConditionModel" and unet._compiled_call_impl is not None
    assert "compile=default(unet)" in engine.description
    assert engine.loras.slots is not None and all(
        isinstance(module, SlotLinear) for module in engine.loras.slots.layers.values()
    )
    jobs = jobs_of(engine, SETS)
    together = run(engine, jobs)
    reference = Reference(MODEL)
    for (_, job), (_, lora_set), decoded in zip(jobs, SETS, together, strict=True):
        if lora_set:  # alone, a set runs the slots' graph at 2 rows (no LoRA: the plain graph, compiled elsewhere)
            (alone,) = run(engine, [(0, job)])
            assert_same_images(decoded, alone)
        files = [(lora_dir / f"{name}.safetensors", weight) for name, weight in lora_set]
        assert_same_images(decoded, expected(reference, job, files))
        if lora_set:  # the slots added each set's deltas: the image is not the one without LoRA
            assert_moved(decoded.images[0], expected(reference, job).images[0], f"LoRA set {lora_set}")


def test_a_new_adapter_and_an_eviction_recompile_nothing(engine, lora_dir):
    sets = [(0, (("attention", 0.5),)), (0, ())]
    run(engine, jobs_of(engine, sets))  # both graphs of this shape compiled
    graphs = counters["stats"]["unique_graphs"]
    late = [(0, (("late", 0.9), ("attention", 0.3))), (0, ())]  # a fourth LoRA: one of three slots evicted
    jobs = jobs_of(engine, late)
    decoded = run(engine, jobs)
    assert counters["stats"]["unique_graphs"] == graphs
    files = [(lora_dir / "late.safetensors", 0.9), (lora_dir / "attention.safetensors", 0.3)]
    reference = Reference(MODEL)
    assert_same_images(decoded[0], expected(reference, jobs[0][1], files))
    assert_moved(decoded[0].images[0], expected(reference, jobs[0][1]).images[0], "the late set")


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("conv", "is not served with a compiled denoiser"),
        ("wide", "rank 16"),
        ("loha-convs", "is not served with a compiled denoiser"),
    ],
)
def test_what_the_slots_cannot_hold_is_refused_by_name(engine, name, says):
    plan = [(0, (("attention", 0.5),))]
    run(engine, jobs_of(engine, plan))  # this shape's graph compiled
    graphs = counters["stats"]["unique_graphs"]
    with pytest.raises(EntryError, match=says) as refused:
        engine.loras.acquire([(name, 1.0)], in_use=())
    assert refused.value.rule == "lora_unloadable"
    assert not hasattr(engine.family.denoiser, "peft_config")  # PEFT's layers are out again
    run(engine, jobs_of(engine, plan))  # the denoiser's own modules are back: nothing recompiles
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_loha_in_the_slots_beside_a_lora_equals_its_delta_merged(engine, lora_dir):
    sets = [(0, (("loha", 0.8),)), (0, (("attention", 0.5),))]
    jobs = jobs_of(engine, sets)
    decoded = run(engine, jobs)
    reference = Reference(MODEL)
    loha, attention = lora_dir / "loha.safetensors", lora_dir / "attention.safetensors"
    assert_same_images(decoded[0], expected(reference, jobs[0][1], lycoris=[(loha, 0.8)]))
    assert_same_images(decoded[1], expected(reference, jobs[1][1], [(attention, 0.5)]))
    assert_moved(decoded[0].images[0], expected(reference, jobs[0][1]).images[0], "the LoHa")


def region_codes(denoiser) -> int:
    """The codes a compiled denoiser's step cache compiles apart: its attention layers' and mid
    block's (a UNet), its transformer blocks' (SD 3)."""
    if hasattr(denoiser, "transformer_blocks"):
        return 1
    attentions = [
        attention
        for block in [*denoiser.down_blocks, *denoiser.up_blocks]
        for attention in getattr(block, "attentions", None) or []
    ]
    return len({type(module) for module in [*attentions, denoiser.mid_block]})


def test_cached_jobs_on_the_compiled_unet_equal_the_helper_beside_uncached_ones_in_a_few_graphs(engine, lora_dir):
    """DeepCache rows (two intervals and branches, one with a LoRA set in the slots) and uncached
    rows share the compiled UNet's forwards, each equal to diffusers' call under the DeepCache
    helper. The regions compile at most four graphs a code (with and without LoRA rows, each
    static, then with the rows' count dynamic), so other row counts and branches add none, and
    forwards without cached rows keep the whole-model graph."""
    assert "step_cache=deep(compiled regions)" in engine.description
    uncached = [(0, (("attention", 0.5),)), (0, ())]
    run(engine, jobs_of(engine, uncached))  # the whole-model graphs of this shape compiled
    before = compiled_graphs()
    sets = [(0, (("attention", 0.8),)), (0, ()), (1, ()), (1, (("attention", 0.5),))]
    caches = [StepCache(mode="deep", interval=2), StepCache(mode="deep", interval=3, branch=1), None, None]
    jobs = [
        (joins, replace(job, cache=cache)) for (joins, job), cache in zip(jobs_of(engine, sets), caches, strict=True)
    ]
    reference = Reference(MODEL)
    for (_, job), (_, lora_set), image in zip(jobs, sets, run(engine, jobs), strict=True):
        files = [(lora_dir / f"{name}.safetensors", weight) for name, weight in lora_set]
        assert_same_images(image, expected(reference, job, files))
    others = replace(jobs[0][1], seeds=(7, 8), cache=StepCache(mode="deep", interval=4, branch=2))
    run(engine, [(0, others), (1, jobs[1][1]), (2, jobs[2][1])])
    regions = compiled_graphs() - before
    assert 0 < regions <= 4 * region_codes(engine.family.denoiser), regions
    run(engine, jobs_of(engine, uncached))
    assert compiled_graphs() - before == regions, "an uncached forward compiled more"


def test_every_slot_in_use_is_busy(engine):
    held = {adapter for adapter, _ in engine.loras.acquire([("attention", 1.0), ("feed-forward", 1.0)], in_use=())}
    held |= {adapter for adapter, _ in engine.loras.acquire([("kohya", 1.0)], in_use=held)}
    with pytest.raises(Busy, match="all 3 LoRA slots"):
        engine.loras.acquire([("late", 1.0)], in_use=held)
    assert engine.loras.slots.free == 0


def test_a_lora_of_the_text_encoders_only_takes_no_slot_so_full_slots_do_not_refuse_it(engine, lora_dir):
    held = {adapter for adapter, _ in engine.loras.acquire([("attention", 1.0), ("feed-forward", 1.0)], in_use=())}
    held |= {adapter for adapter, _ in engine.loras.acquire([("kohya", 1.0)], in_use=held)}
    assert engine.loras.slots.free == 0
    adapters = engine.loras.acquire([("text-only", 1.0)], in_use=held)
    assert engine.loras.slots.free == 0 and not engine.loras.slots.needs_slot(adapters[0][0])
    job = spec("a red circle", 3, side=32, steps=3, adapters=adapters)
    attention = held_attention(engine, held | {adapters[0][0]})
    beside = spec("a blue square", 4, side=32, steps=3, adapters=((attention, 1.0),))
    reference = Reference(MODEL)
    decoded, _ = run(engine, [(0, job), (0, beside)])  # beside a slot's rows: the slots' graph, compiled already
    assert_same_images(decoded, expected(reference, job, [(lora_dir / "text-only.safetensors", 1.0)]))
    assert_moved(decoded.images[0], expected(reference, job).images[0], "the text encoders' LoRA")


def held_attention(engine, held: set[str]) -> str:
    """The id of the loaded ``attention`` LoRA, one of ``held``."""
    (adapter,) = [adapter for adapter, _ in engine.loras.acquire([("attention", 1.0)], in_use=held)]
    return adapter


@pytest.mark.parametrize(("family", "scheduler"), [("sdxl", "euler"), ("sd3", "flow_match_euler")])
def test_other_families_mixed_sets_in_compiled_forwards_equal_diffusers(family, scheduler, tmp_path):
    """SDXL's UNet (linear projections, two text encoders) and SD 3's transformer (MMDiT blocks, with
    a first-block cached job joining mid-flight: its blocks compiled apart)."""
    model = TINY_MODEL_DIRS[family]
    write_lora(model, tmp_path / "attention.safetensors", seed=1)
    write_lora(model, tmp_path / "feed-forward.safetensors", seed=2, layers=("feed_forward",), spread=0.1)
    settings = {
        "model_path": str(model),
        "compile": {"enabled": True, "targets": ["unet"]},
        "loras": {"dir": str(tmp_path), "max_loaded": 2, "slot_rank": 4},
    }
    engine = load_engine(HandlerSettings.model_validate(settings), "/unused")
    sets = [(0, ()), (0, (("attention", 0.8),)), (0, (("feed-forward", 1.0), ("attention", -0.5)))]
    if family == "sd3":  # a first-block cached job joins mid-flight: the transformer's blocks compiled apart
        sets.append((1, (("attention", 0.8),)))
    jobs = lora_set_jobs(engine, sets, steps=3, scheduler=scheduler)
    if family == "sd3":
        jobs[-1] = (1, replace(jobs[-1][1], cache=StepCache(mode="first_block", threshold=0.3)))
    before = compiled_graphs()
    images = run(engine, jobs)
    if family == "sd3":  # the whole model's (with LoRA rows), then the regions'
        assert 0 < compiled_graphs() - before <= 1 + 4 * region_codes(engine.family.denoiser)
    reference = Reference(model)
    for (_, job), (_, lora_set), decoded in zip(jobs, sets, images, strict=True):
        files = [(tmp_path / f"{name}.safetensors", weight) for name, weight in lora_set]
        assert_same_images(decoded, expected(reference, job, files))
        if lora_set:
            assert_moved(decoded.images[0], expected(reference, job).images[0], f"LoRA set {lora_set}")
