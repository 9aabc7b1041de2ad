"""Forwards padded to a captured row count (``handler.compile.pad_rows``, for the compiled
denoiser's CUDA graphs) give the same images as unpadded ones: every family, with LoRA rows,
ControlNets, an image-to-image and an inpainting job in the forward; the padding rows are dropped.
A forward with a step cache is not padded."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._inductor import cudagraph_trees

from handler.adapters.lora_slots import SlotLoras
from handler.config import CompileSettings
from handler.engine.loading import cuda_graph_skips
from handler.engine.step_engine import padded_count
from tests.harness.engine_runs import assert_same_images, engine_with_adapters, jobs_of_every_kind, stepped_together

# Inductor's fused float16 kernels round otherwise than eager's: on an H200 (2026-11-27) this test's
# images moved by 2 levels, as SD 1.5's compiled pipeline did at 512x512 (docs/performance.md); a
# lost LoRA row or a misplaced padding row moves them by tens.
# The cudagraphs backend replays eager's own kernels, but the LoRA rows' slots (where eager runs
# PEFT's layers) and the padded row count (cuBLAS and cuDNN may pick another algorithm for another
# batch) may round otherwise: not yet measured, so the same bound.
COMPILED_TOLERANCE = 3


def test_a_forward_is_padded_to_the_least_count_at_or_above_its_rows():
    counts = (1, 2, 4, 8, 16, 24, 32)
    assert [padded_count(rows, counts) for rows in (1, 3, 8, 9, 17, 25, 32, 33)] == [1, 4, 8, 16, 24, 32, 32, 33]
    assert padded_count(5, ()) == 5


def test_padding_is_on_where_the_compiled_denoiser_replays_cuda_graphs():
    graphs = CompileSettings(enabled=True, mode="reduce-overhead")
    assert graphs.row_counts("cuda") == (1, 2, 4, 8, 16, 24, 32)
    assert graphs.row_counts("cpu") == () and CompileSettings(enabled=True).row_counts("cuda") == ()
    assert CompileSettings(enabled=True, mode="max-autotune").row_counts("cuda")
    assert CompileSettings(pad_rows="on", graph_rows=(8, 4)).row_counts("cpu") == (4, 8)
    assert CompileSettings(enabled=True, mode="reduce-overhead", pad_rows="off").row_counts("cuda") == ()
    assert graphs.cuda_graphs("cuda") and not graphs.cuda_graphs("cpu")
    assert not CompileSettings(enabled=True, mode="max-autotune-no-cudagraphs").cuda_graphs("cuda")
    eager_kernels = CompileSettings(enabled=True, backend="cudagraphs")
    assert eager_kernels.cuda_graphs("cuda") and not eager_kernels.cuda_graphs("cpu")
    assert eager_kernels.row_counts("cuda") == (1, 2, 4, 8, 16, 24, 32) and eager_kernels.row_counts("cpu") == ()


def test_a_compiled_denoiser_of_a_guided_model_runs_a_single_row_as_two():
    """Warm-up compiles what the model's defaults step: two rows an image when they are guided, so a
    single row (one unguided image) pads up instead of compiling while serving; an unguided model's
    warm-up compiles one row, and an eager denoiser compiles nothing."""
    graphs = CompileSettings(enabled=True, mode="reduce-overhead")
    assert graphs.row_counts("cuda", guided=True) == (2, 4, 8, 16, 24, 32)
    assert graphs.row_counts("cuda", guided=False) == (1, 2, 4, 8, 16, 24, 32)
    assert CompileSettings(enabled=True).row_counts("cpu", guided=True) == (2,)
    assert CompileSettings(enabled=True).row_counts("cpu", guided=False) == ()
    assert CompileSettings(enabled=True, graph_rows=(1,), pad_rows="on").row_counts("cpu", guided=True) == (2,)
    assert CompileSettings(enabled=True, targets=["vae_decoder"]).row_counts("cpu", guided=True) == ()
    assert CompileSettings().row_counts("cuda", guided=True) == ()


def decoded(engine, jobs):
    """Step the jobs together to the end, counting the denoiser's rows per forward; each job decoded."""
    rows, forward = [], engine.family.forward

    def counted(latents, *args, **kwargs):  # around the family's call: the (compiled) denoiser is untouched
        rows.append(latents.shape[0])
        return forward(latents, *args, **kwargs)

    engine.family.forward = counted
    try:
        return stepped_together(engine, jobs), rows
    finally:
        del engine.family.forward


# The first forward's rows of jobs_of_every_kind with its cached jobs: two DeepCache jobs (UNet
# families) or a first-block one (SD 3) beside the 11 rows of the others.
FIRST_ROWS = {"sd1": 15, "sdxl": 15, "sd3": 13}


@pytest.mark.parametrize("family", ["sd1", "sdxl", "sd3"])
def test_padded_forwards_give_the_unpadded_images_and_a_step_caches_forward_is_not_padded(family, tmp_path):
    """Padding rows (copies of the last, with its LoRA set) beside LoRA, ControlNet (UNet families),
    image-to-image and inpainting rows are dropped; a forward with a step cache (DeepCache of two
    branches in different blocks, one with a LoRA and a ControlNet; first-block caching with a LoRA)
    or SD 3's ControlNet rows runs the denoiser's own forward, never a captured graph, so it is not
    padded."""
    engine = engine_with_adapters(family, tmp_path)
    padded = dataclasses.replace(engine, row_counts=(4, 16))
    scheduler = engine.family.rules.own_scheduler
    controlnets = not engine.family.controls_in_blocks  # SD 3's are the cached forwards' case below
    plain, _ = decoded(engine, jobs_of_every_kind(engine, scheduler, controlnets=controlnets))
    ours, padded_rows_seen = decoded(padded, jobs_of_every_kind(padded, scheduler, controlnets=controlnets))
    assert set(padded_rows_seen) == {16}
    for theirs, mine in zip(plain, ours, strict=True):
        assert_same_images(mine, theirs)
    cached = {"cached": True, "first_block": True}
    plain, plain_rows = decoded(engine, jobs_of_every_kind(engine, scheduler, **cached))
    ours, rows_seen = decoded(padded, jobs_of_every_kind(padded, scheduler, **cached))
    assert plain_rows[0] == FIRST_ROWS[family] and rows_seen == plain_rows
    for theirs, mine in zip(plain, ours, strict=True):
        assert_same_images(mine, theirs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    ("compiled", "tolerance"),
    [
        ({"mode": "reduce-overhead"}, COMPILED_TOLERANCE),
        ({"backend": "cudagraphs"}, COMPILED_TOLERANCE),
    ],
    ids=["inductor", "cudagraphs"],
)
def test_on_a_gpu_cuda_graphs_give_the_eager_images(compiled, tolerance, tmp_path, monkeypatch):
    """The compiled denoiser replaying CUDA graphs (inductor's kernels in reduce-overhead mode, and
    eager's with the cudagraphs backend; its forwards padded, LoRA rows in its slots) against the
    eager one, the same jobs of every kind: every graph is recorded (none skipped), and once two
    runs warmed them up and recorded them the third replays them (a static input that moved, such as
    a LoRA plan made anew each step, would record a graph again at every step)."""
    torch._dynamo.reset()  # a worker's process: the other backend's graphs and CUDA graphs gone
    skipped, recorded, plans = cuda_graph_skips(), [], []
    record, plan = cudagraph_trees.CUDAGraphTreeManager.record_function, SlotLoras.plan

    def counted(manager, *args, **kwargs):
        recorded.append(1)
        return record(manager, *args, **kwargs)

    def kept_alive(slots, *args, **kwargs):  # each plan made elsewhere: a plan the graphs read would move
        plans.append(plan(slots, *args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(cudagraph_trees.CUDAGraphTreeManager, "record_function", counted)
    monkeypatch.setattr(SlotLoras, "plan", kept_alive)
    settings = {"compile": {"enabled": True, "targets": ["unet"], **compiled}}
    eager = engine_with_adapters("sd1", tmp_path / "eager", device="cuda")
    graphs = engine_with_adapters("sd1", tmp_path / "graphs", device="cuda", **settings)
    assert graphs.cuda_graphs and graphs.row_counts
    scheduler = eager.family.rules.own_scheduler
    theirs, _ = decoded(eager, jobs_of_every_kind(eager, scheduler))
    for _ in range(2):  # cudagraph trees warm a graph up at its first call and record it at the second
        decoded(graphs, jobs_of_every_kind(graphs, scheduler))
    first = len(recorded)
    ours, rows = decoded(graphs, jobs_of_every_kind(graphs, scheduler))
    assert set(rows) <= set(graphs.row_counts)
    assert first > 0 and len(recorded) == first, f"{len(recorded) - first} graphs recorded again ({first} first)"
    assert cuda_graph_skips() == skipped, "a graph ran without CUDA graphs (torch logged why)"
    for mine, reference in zip(ours, theirs, strict=True):
        assert_same_images(mine, reference, tolerance)
