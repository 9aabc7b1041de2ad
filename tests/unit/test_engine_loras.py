"""Jobs with different LoRA sets (or none) in one denoiser forward, per family (tiny random-weight
SD 1.x, SDXL, SD 3): LoRAs on attention and the text encoders, on convolutions and feed-forward
layers (for SD 1.x also a kohya LoCon file with alphas apart from its ranks), alone and mixed,
joining mid-flight; each image equals the same job alone and diffusers' ``load_lora_weights`` +
``set_adapters`` call. LyCORIS LoHa and LoKr files (SD 1.x, SDXL; made by the ``lycoris-lora``
package) beside plain LoRAs: each image equals the pipeline with their deltas merged into its
weights."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from bench.reference import Reference
from handler.config import HandlerSettings
from handler.engine.loading import load_engine
from model_making.make_lora import write_lora, write_lycoris
from server.paths import TINY_MODEL_DIRS
from tests.harness.engine_runs import EVERY_STEP_SKIPPING, assert_same_images, expected, lora_set_jobs, run
from tests.harness.images import assert_moved

SCHEDULERS = {"sd1": "ddim", "sdxl": "euler", "sd3": "flow_match_euler"}
LORAS = {  # name: how make_lora writes it (conv and feed-forward LoRAs smaller: the tiny models amplify them)
    "attention": dict(seed=1),
    "conv-ff": dict(seed=2, layers=("conv", "feed_forward"), text_encoder=False, spread=0.1),
    "everything": dict(seed=3, layers=("attention", "conv", "feed_forward"), spread=0.1),
}
KOHYA = {"kohya-locon": dict(seed=4, layers=("attention", "conv", "feed_forward"), spread=0.1, kohya=True)}
SETS = [  # (joins at iteration, LoRA set)
    (0, ()),
    (0, (("attention", 0.8),)),
    (0, (("conv-ff", 1.0), ("attention", -0.5))),
    (1, (("everything", 0.6),)),
    (1, (("attention", 0.3),)),
]
KOHYA_SETS = [(1, (("kohya-locon", 0.9), ("attention", 0.5)))]


@pytest.mark.parametrize("family", list(SCHEDULERS))
def test_jobs_with_other_lora_sets_share_forwards_and_each_equals_diffusers(family, tmp_path):
    model_dir = TINY_MODEL_DIRS[family]
    loras, sets = (LORAS | KOHYA, SETS + KOHYA_SETS) if family == "sd1" else (LORAS, SETS)
    for name, recipe in loras.items():
        write_lora(model_dir, tmp_path / f"{name}.safetensors", **recipe)
    settings = {"model_path": str(model_dir), "loras": {"dir": str(tmp_path), "max_loaded": len(loras)}}
    engine = load_engine(HandlerSettings.model_validate(settings), "/unused")
    jobs = lora_set_jobs(engine, sets, steps=4, scheduler=SCHEDULERS[family])
    if family == "sd3":  # a LoRA job's skip-layer rows with its LoRA set
        joins, job = jobs[1]
        jobs[1] = (joins, replace(job, skip_layer_guidance=EVERY_STEP_SKIPPING))
    together = run(engine, jobs)  # each iteration's jobs in one forward, whatever their sets
    reference = Reference(model_dir)
    for (_, job), (_, lora_set), decoded in zip(jobs, sets, together, strict=True):
        (alone,) = run(engine, [(0, job)])
        assert_same_images(decoded, alone)
        files = [(Path(tmp_path) / f"{name}.safetensors", weight) for name, weight in lora_set]
        theirs = expected(reference, job, files)
        assert_same_images(decoded, theirs)
        if lora_set:  # and the LoRAs changed the image
            assert_moved(decoded.images[0], expected(reference, job).images[0], f"LoRA set {lora_set}")


LYCORIS = {  # name: how write_lycoris writes it (every UNet layer LyCORIS's full preset takes, the text encoders)
    "loha": dict(algo="loha", seed=5),
    "loha-tucker": dict(algo="loha", seed=6, alpha=4.0, use_tucker=True, text_encoder=False),  # 3x3 convs: Tucker
    "lokr": dict(algo="lokr", seed=7, decompose_both=True),
}
LYCORIS_SETS = [
    (0, (("loha", 0.8),)),
    (0, (("lokr", 1.0), ("plain", 0.5))),
    (0, ()),
    (1, (("loha-tucker", 0.7), ("lokr", -0.6))),
]


@pytest.mark.parametrize(("family", "scheduler"), [("sd1", "ddim"), ("sdxl", "euler")])
def test_loha_and_lokr_beside_plain_loras_in_one_forward_equal_their_deltas_merged(family, scheduler, tmp_path):
    model_dir = TINY_MODEL_DIRS[family]
    for name, recipe in LYCORIS.items():
        write_lycoris(model_dir, tmp_path / f"{name}.safetensors", **recipe)
    write_lora(model_dir, tmp_path / "plain.safetensors", seed=1)
    settings = {"model_path": str(model_dir), "loras": {"dir": str(tmp_path), "max_loaded": len(LYCORIS) + 1}}
    engine = load_engine(HandlerSettings.model_validate(settings), "/unused")
    jobs = lora_set_jobs(engine, LYCORIS_SETS, steps=4, scheduler=scheduler)
    together = run(engine, jobs)
    reference = Reference(model_dir)
    for (_, job), (_, lora_set), decoded in zip(jobs, LYCORIS_SETS, together, strict=True):
        files = [(tmp_path / f"{name}.safetensors", weight) for name, weight in lora_set]
        plain = [(path, weight) for path, weight in files if path.stem == "plain"]
        lycoris = [(path, weight) for path, weight in files if path.stem != "plain"]
        assert_same_images(decoded, expected(reference, job, plain, lycoris=lycoris))
        if lora_set:
            assert_moved(decoded.images[0], expected(reference, job).images[0], f"LoRA set {lora_set}")
