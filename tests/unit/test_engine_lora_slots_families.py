"""LoRA sets in the compiled denoisers of SDXL's and SD 3's tiny models (``handler.adapters.lora_slots``):
jobs with different sets share forwards and each image equals diffusers' ``load_lora_weights`` +
``set_adapters`` call. SDXL's UNet runs the cudagraphs backend (``compile.backend``: dynamo's graph of
the eager kernels, which on a GPU replays as CUDA graphs; its VAE decoder and DeepCache's regions
stay eager). SD 3's transformer runs inductor on the CPU, with a first-block cached job joining its
forwards mid-flight (its blocks compiled apart) that equals diffusers' First Block Cache in a few
graphs, beside a ControlNet job with a LoRA (the same forwards: no more graphs) that equals
``StableDiffusion3ControlNetPipeline``. SD 1.x: tests/unit/test_engine_lora_slots.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from bench.reference import ControlNetCall, Reference
from handler.adapters.controlnets import ControlSpec
from handler.adapters.lora_slots import compiled_graphs
from handler.config import HandlerSettings, StepCache
from handler.engine.loading import inductor_cache_counts, load_engine
from model_making.make_controlnet import write_controlnet
from model_making.make_lora import write_lora
from server.paths import TINY_MODEL_DIRS
from tests.harness.engine_runs import assert_same_images, expected, lora_set_jobs, picture, run
from tests.harness.images import assert_moved

pytestmark = pytest.mark.slow  # compiles the tiny denoisers (SD 3's inductor graphs: about a minute here)


def inductor_graphs() -> int:
    """Graphs inductor generated code for in this process, or found in its cache."""
    return sum(inductor_cache_counts())


@pytest.mark.parametrize(
    ("family", "scheduler", "backend"), [("sdxl", "euler", "cudagraphs"), ("sd3", "flow_match_euler", "inductor")]
)
def test_other_families_mixed_sets_in_compiled_forwards_equal_diffusers(family, scheduler, backend, tmp_path):
    """SDXL's UNet (linear projections, two text encoders) on the cudagraphs backend, and SD 3's
    transformer (MMDiT blocks, with a first-block cached job and a ControlNet job joining mid-flight:
    its blocks compiled apart) on inductor."""
    torch._dynamo.reset()  # a worker's process: nothing learnt from other models' compiles (dynamic rows)
    model = TINY_MODEL_DIRS[family]
    write_lora(model, tmp_path / "attention.safetensors", seed=1)
    write_lora(model, tmp_path / "feed-forward.safetensors", seed=2, layers=("feed_forward",), spread=0.1)
    write_lora(model, tmp_path / "both.safetensors", seed=3, layers=("attention", "feed_forward"), spread=0.1)
    settings = {
        "model_path": str(model),
        "compile": {"enabled": True, "backend": backend},  # the default targets: the denoiser and the VAE decoder
        "loras": {"dir": str(tmp_path), "max_loaded": 3, "slot_rank": 4},
        "controlnets": {"dir": str(tmp_path / "controlnets")},
    }
    write_controlnet(model, tmp_path / "controlnets" / "edges", seed=1)
    engine = load_engine(HandlerSettings.model_validate(settings), "/unused")
    if backend == "cudagraphs":  # it records the denoiser's kernels; the decoder and the cache's regions stay eager
        assert "compile=cudagraphs(unet) pad_rows=2 step_cache=deep " in f"{engine.description} "
        assert not engine.compiled_decoder and engine.deep_cache is not None and not engine.deep_cache.compiled
    sets = [(0, ()), (0, (("attention", 0.8),)), (0, (("feed-forward", 1.0), ("attention", -0.5)))]
    if family == "sd3":  # a first-block cached job joins mid-flight: the transformer's blocks compiled apart
        sets.append((1, (("attention", 0.8),)))
    else:  # a job of three LoRAs joins mid-flight: each row gathers 3 slots, not 2, in the same graph
        sets.append((1, (("both", 0.6), ("feed-forward", -0.7), ("attention", 0.3))))
    jobs = lora_set_jobs(engine, sets, steps=3, scheduler=scheduler)
    if family == "sd3":  # and a ControlNet job with a LoRA beside it
        jobs[-1] = (1, replace(jobs[-1][1], cache=StepCache(mode="first_block", threshold=0.3)))
        control = (ControlSpec(engine.controlnets.acquire(["edges"], in_use=())[0], picture(32, 3), 0.9),)
        jobs.append((1, replace(jobs[1][1], prompt="a red circle controlled", seeds=(7,), controls=control)))
        sets.append(sets[1])
    before, generated = compiled_graphs(), inductor_graphs()
    images = run(engine, jobs)
    assert (inductor_graphs() > generated) == (backend == "inductor"), "only inductor generates kernels"
    if family == "sd3":  # the whole model's (with LoRA rows), then the blocks' (one code: at most 4 graphs)
        assert 0 < compiled_graphs() - before <= 1 + 4
    else:  # one graph with LoRA rows for every row count and every count of slots a row gathers
        assert compiled_graphs() - before == 1
    reference = Reference(model)
    for (_, job), (_, lora_set), decoded in zip(jobs, sets, images, strict=True):
        files = [(tmp_path / f"{name}.safetensors", weight) for name, weight in lora_set]
        nets = [ControlNetCall(tmp_path / "controlnets" / "edges", c.image, c.scale) for c in job.controls]
        assert_same_images(decoded, expected(reference, job, files, nets))
        if lora_set:
            assert_moved(decoded.images[0], expected(reference, job).images[0], f"LoRA set {lora_set}")
