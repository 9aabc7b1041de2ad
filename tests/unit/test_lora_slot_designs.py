"""The two designs of a denoiser's LoRA slots (``handler.adapters.lora_slots``, ``loras.slot_design``)
on the default model's UNet, uncompiled: each row of one forward gets the output of diffusers'
``load_lora_weights`` + ``set_adapters`` with its own set, whether it gathers its own slots (as many
as the forward's rows hold, a size marked dynamic; or a static count, as where the graphs are
static) or multiplies by every slot, with sets of no, one, two and three LoRAs side by side; which
compile settings take the static count. Compiled: tests/unit/test_engine_lora_slots.py and
tests/unit/test_engine_lora_slots_families.py (the default, dynamic count), bench/loras.py (both
designs). Where CUDA graphs replay, a forward's plan is kept in place."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import pytest
import torch
from diffusers import StableDiffusionPipeline

from handler.adapters.lora_slots import SlotLinear, SlotLoras
from handler.config import HandlerSettings, SlotDesign
from handler.engine.loading import lora_slots
from model_making.make_lora import write_lora
from server.paths import DEFAULT_MODEL_DIR

LORAS = {  # name: how make_lora writes it
    "attention": dict(seed=1, rank=4),
    "feed-forward": dict(seed=2, rank=8, layers=("feed_forward",), spread=0.1),
    "both": dict(seed=3, rank=2, layers=("attention", "feed_forward"), spread=0.1),
}
SETS = [  # (LoRA set, rows)
    ((), 2),
    ((("attention", 0.8),), 1),
    ((("feed-forward", 1.0), ("attention", -0.5)), 2),
    ((("both", 0.7), ("attention", 0.4), ("feed-forward", -1.2)), 1),
]


@pytest.fixture(scope="module")
def lora_files(tmp_path_factory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("loras")
    return {
        name: write_lora(DEFAULT_MODEL_DIR, directory / f"{name}.safetensors", **recipe)
        for name, recipe in LORAS.items()
    }


@pytest.fixture(scope="module")
def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    rows = sum(count for _, count in SETS)
    latents = torch.randn(rows, 4, 8, 8, generator=generator)
    hidden = torch.randn(rows, 77, 32, generator=generator)
    return latents, torch.full((rows,), 500.0), hidden


@pytest.fixture(scope="module")
def expected(lora_files, inputs) -> torch.Tensor:
    """Each set's rows through diffusers' UNet with PEFT's adapters set to it."""
    pipeline = StableDiffusionPipeline.from_pretrained(DEFAULT_MODEL_DIR)
    for name, path in lora_files.items():
        pipeline.load_lora_weights(path, adapter_name=name)
    latents, timesteps, hidden = inputs
    outputs, start = [], 0
    for adapter_set, count in SETS:
        rows = slice(start, start + count)
        start += count
        if adapter_set:
            pipeline.enable_lora()
            pipeline.set_adapters([name for name, _ in adapter_set], [scale for _, scale in adapter_set])
        else:
            pipeline.disable_lora()
        with torch.no_grad():
            outputs.append(pipeline.unet(latents[rows], timesteps[rows], hidden[rows]).sample)
    return torch.cat(outputs)


@pytest.mark.parametrize(
    ("design", "per_row"),
    [(design, None) for design in get_args(SlotDesign)] + [("gathered", 4)],
    ids=["gathered", "stacked", "gathered-static"],
)
def test_each_row_of_a_forward_gets_its_own_set(design, per_row, lora_files, inputs, expected):
    pipeline = StableDiffusionPipeline.from_pretrained(DEFAULT_MODEL_DIR)
    unet = pipeline.unet
    slots = SlotLoras(unet, slots=4, rank=8, design=design, per_row=per_row)
    for name, path in lora_files.items():  # as the LoRA library loads one into a compiled denoiser
        pipeline.load_lora_weights(path, adapter_name=name)
        slots.take(name)
        unet.unload_lora()
    assert any(isinstance(module, SlotLinear) for module in unet.modules()) and slots.free == 1
    latents, timesteps, hidden = inputs
    with torch.no_grad(), slots.rows(SETS, torch.device("cpu")) as plan:
        assert plan is not None and (plan.slots is None) == (design == "stacked")
        if design == "gathered":  # each row its own slots: the most any row holds, or the static count
            assert plan.slots.shape == plan.weights.shape == (6, per_row or 3)
            # dynamo's mark of a dynamic size (torch._dynamo.maybe_mark_dynamic): only where the count varies
            marked = [getattr(tensor, "_dynamo_weak_dynamic_indices", set()) for tensor in plan]
            assert marked == ([{1}, {1}] if per_row is None else [set(), set()])
        noise = unet(latents, timesteps, hidden).sample
    torch.testing.assert_close(noise, expected, rtol=1e-4, atol=1e-5)
    with torch.no_grad(), slots.rows([((), 6)], torch.device("cpu")) as plan:  # no LoRA row: the plain graph
        assert plan is None
        torch.testing.assert_close(unet(latents, timesteps, hidden).sample[:2], expected[:2], rtol=1e-4, atol=1e-5)
    with slots.lora_graph(), slots.rows([((), 6)], torch.device("cpu")) as plan:  # warm-up's graph with LoRA rows
        assert plan is not None and plan.weights.abs().sum() == 0
        if design == "gathered":  # the shape served: the static count, or 2 (marked dynamic)
            assert plan.slots.shape == (6, per_row or 2)


def test_where_cuda_graphs_replay_a_forwards_plan_is_kept_in_place_and_a_sub_batchs_is_not(
    lora_files, inputs, expected
):
    """dynamo makes the tensors the slot layers read static inputs of the denoiser's graph, which a
    CUDA graph reads where it recorded them (and is recorded again for where they moved): each
    forward's plan of one shape is the same tensors, refilled, and its rows still get their sets; a
    sub-batch's plan (nested in its forward's, a step cache's) is its own."""
    pipeline = StableDiffusionPipeline.from_pretrained(DEFAULT_MODEL_DIR)
    unet = pipeline.unet
    slots = SlotLoras(unet, slots=4, rank=8, per_row=3, replayed=True)
    for name, path in lora_files.items():
        pipeline.load_lora_weights(path, adapter_name=name)
        slots.take(name)
        unet.unload_lora()
    latents, timesteps, hidden = inputs
    cpu = torch.device("cpu")
    with torch.no_grad(), slots.rows(SETS, cpu) as first:
        assert first is not None
        kept = [tensor.data_ptr() for tensor in first if tensor is not None]
        torch.testing.assert_close(unet(latents, timesteps, hidden).sample, expected, rtol=1e-4, atol=1e-5)
    reordered = SETS[::-1]  # the same rows and slots a row: the same shape
    with slots.rows(reordered, cpu) as second:
        assert second is not None and [tensor.data_ptr() for tensor in second if tensor is not None] == kept
        fresh = slots.plan(reordered, cpu)
        assert fresh is not None and all(torch.equal(mine, theirs) for mine, theirs in zip(second, fresh, strict=True))
        with slots.rows(reordered, cpu) as nested:
            assert nested is not None and nested.weights.data_ptr() not in kept
        assert slots.state.rows is second


@pytest.mark.parametrize(
    ("compile_settings", "device", "per_row"),
    [
        ({"mode": "default"}, "cuda", None),  # one graph for any count of slots a row gathers
        ({"mode": "default"}, "cpu", None),
        ({"mode": "reduce-overhead"}, "cuda", 3),  # CUDA graphs record each size: as many as a request holds
        ({"mode": "reduce-overhead"}, "cpu", None),  # no CUDA graphs off CUDA
        ({"mode": "default", "dynamic": False}, "cpu", 3),  # static shapes asked for
        ({"mode": "max-autotune"}, "cuda", 3),
        ({"mode": "max-autotune-no-cudagraphs"}, "cuda", None),
        ({"mode": "reduce-overhead", "dynamic": True}, "cuda", 3),  # a dynamic graph's CUDA graphs: per size
        ({"backend": "cudagraphs"}, "cuda", 3),  # eager's kernels in CUDA graphs
        ({"backend": "cudagraphs"}, "cpu", None),
    ],
)
def test_rows_gather_a_static_count_of_slots_where_the_graphs_are_static(compile_settings, device, per_row):
    """As many slots as a request may hold LoRAs, and no more than are loaded."""
    for max_loaded, expected_per_row in ((8, per_row), (2, per_row and 2)):
        settings = HandlerSettings.model_validate(
            {
                "compile": {"enabled": True, "targets": ["unet"], **compile_settings},
                "loras": {"max_loaded": max_loaded},
                "limits": {"max_loras_per_request": 3},
            }
        )
        slots = lora_slots(settings, torch.nn.Module(), torch.device(device))
        assert slots.per_row == expected_per_row
        assert slots.replayed == settings.compile.cuda_graphs(device)  # its forwards' plans kept in place
