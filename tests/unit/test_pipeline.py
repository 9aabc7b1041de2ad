"""Pipeline loading and optimization on the default tiny model, in-process."""

from pathlib import Path

import numpy as np
import pytest
import torch

from handler.batching import CallInputs, CallKey
from handler.config import HandlerSettings
from handler.pipeline import attention_summary, load_text_to_image, native_size, resolve_dtype

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "tiny-sd"


def load(**settings):
    return load_text_to_image(HandlerSettings.model_validate({"model_path": str(MODEL_DIR), **settings}), "/unused")


@pytest.fixture(scope="module")
def engine():
    return load()


def test_dtype_auto_is_float32_on_cpu_and_float16_on_gpus():
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.float16
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


def test_sdpa_is_on_every_attention_module(engine):
    assert engine.dtype == torch.float32 and engine.device.type == "cpu"
    assert "attention=AttnProcessor2_0 on 14 modules" in engine.description
    assert native_size(engine.pipeline) == (64, 64)


def test_attention_check_catches_a_module_without_the_configured_processor():
    from diffusers.models.attention_processor import AttnProcessor

    pipeline = load().pipeline
    name = next(iter(pipeline.unet.attn_processors))
    pipeline.unet.set_attn_processor({**pipeline.unet.attn_processors, name: AttnProcessor()})
    with pytest.raises(RuntimeError, match=f"unet.{name} \\(AttnProcessor, expected AttnProcessor2_0\\)"):
        attention_summary(pipeline, HandlerSettings())


def test_vanilla_attention_and_memory_options_are_applied_and_reported():
    engine = load(attention="vanilla", channels_last=True, vae_tiling=True)
    assert "attention=AttnProcessor on 14 modules" in engine.description
    assert "channels_last=True" in engine.description and "vae_tiling=True" in engine.description
    sliced = load(attention_slicing=True)
    assert "SlicedAttnProcessor on 12 modules+AttnProcessor2_0 on 2 modules" in sliced.description


def test_cpu_offload_needs_cuda():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        load(cpu_offload="model")


def test_images_come_from_per_image_seeds(engine):
    key = CallKey(64, 64, 3, "euler_a", 7.5)
    batch, timings = engine.generate(key, CallInputs(["a", "b"], ["", ""], [1, 2], [0, 1]))
    alone, _ = engine.generate(key, CallInputs(["b"], [""], [2], [0]))
    assert len(timings.denoise_steps) == 3 and all(seconds > 0 for seconds in timings.denoise_steps)
    assert timings.vae_decode > 0
    assert [image.size for image in batch] == [(64, 64), (64, 64)]
    difference = np.abs(np.asarray(batch[1], dtype=int) - np.asarray(alone[0], dtype=int))
    assert difference.max() <= 1


def test_compiled_pipeline_gives_the_eager_image():
    """torch.compile (inductor, default mode) of UNet and VAE decoder; slow on a cold cache."""
    compiled = load(compile={"enabled": True, "mode": "default"})
    assert type(compiled.pipeline.unet).__name__ == "OptimizedModule"
    assert "compile=default(unet,vae_decoder)" in compiled.description
    key, inputs = CallKey(64, 64, 2, "ddim", 7.5), CallInputs(["a"], [""], [1], [0])
    (eager,), _ = load().generate(key, inputs)
    (image,), _ = compiled.generate(key, inputs)
    difference = np.abs(np.asarray(image, dtype=int) - np.asarray(eager, dtype=int))
    assert difference.max() <= 1


def test_pickle_only_models_are_refused(tmp_path):
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(MODEL_DIR, copy)
    for weights in copy.rglob("*.safetensors"):
        weights.rename(weights.with_name(weights.name.replace(".safetensors", ".bin")))
    with pytest.raises(OSError, match="safetensors"):
        load_text_to_image(HandlerSettings(model_path=str(copy)), "/unused")


def test_fault_injection_simulates_out_of_memory_above_its_pixel_budget():
    engine = load(fault_injection={"out_of_memory_above_pixels": 64 * 64})
    key = CallKey(64, 64, 1, "ddim", 7.5)
    images, _ = engine.generate(key, CallInputs(["a"], [""], [1], [0]))
    assert len(images) == 1
    with pytest.raises(torch.OutOfMemoryError, match="simulated out of memory: 8192 pixels"):
        engine.generate(key, CallInputs(["a", "b"], ["", ""], [1, 2], [0, 1]))


@pytest.mark.parametrize("scheduler", ["ddim", "euler", "euler_a", "dpmpp_2m", "pndm"])
def test_every_scheduler_runs_from_one_step_up_in_any_order(engine, scheduler):
    for steps in (1, 2, 5, 2):
        images, timings = engine.generate(CallKey(64, 64, steps, scheduler, 7.5), CallInputs(["a"], [""], [1], [0]))
        assert images[0].size == (64, 64) and len(timings.denoise_steps) >= steps
