"""Pipeline loading and optimization on the tiny SD 1.x model, in-process."""

import pytest
import torch

from bench.jobs import generate
from handler.config import HandlerSettings
from handler.engine.jobs import JobSpec
from handler.engine.loading import attention_summary, load_engine, resolve_dtype
from handler.families.sd import SCHEDULERS
from server.paths import RANDOM_MODEL_DIR as MODEL_DIR


def load(**settings):
    return load_engine(HandlerSettings.model_validate({"model_path": str(MODEL_DIR), **settings}), "/unused")


def spec(steps: int = 2, scheduler: str = "ddim", images: int = 1) -> JobSpec:
    return JobSpec("a", None, tuple(range(1, images + 1)), 64, 64, steps, scheduler, 7.5)


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
    assert engine.family.native_size() == (64, 64)


def test_attention_check_catches_a_module_without_the_configured_processor():
    from diffusers.models.attention_processor import AttnProcessor

    family = load().family
    pipeline = family.pipeline
    name = next(iter(pipeline.unet.attn_processors))
    pipeline.unet.set_attn_processor({**pipeline.unet.attn_processors, name: AttnProcessor()})
    with pytest.raises(RuntimeError, match=f"unet.{name} \\(AttnProcessor, expected AttnProcessor2_0\\)"):
        attention_summary(family, HandlerSettings())


def test_vanilla_attention_and_memory_options_are_applied_and_reported():
    engine = load(attention="vanilla", channels_last=True, vae_tiling=True)
    assert "attention=AttnProcessor on 14 modules" in engine.description
    assert "channels_last=True" in engine.description and "vae_tiling=True" in engine.description
    sliced = load(attention_slicing=True)
    assert "SlicedAttnProcessor on 12 modules+AttnProcessor2_0 on 2 modules" in sliced.description


def test_cpu_offload_needs_cuda():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        load(cpu_offload="model")


def test_pickle_only_models_are_refused(tmp_path):
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(MODEL_DIR, copy)
    for weights in copy.rglob("*.safetensors"):
        weights.rename(weights.with_name(weights.name.replace(".safetensors", ".bin")))
    with pytest.raises(OSError, match="safetensors"):
        load_engine(HandlerSettings(model_path=str(copy)), "/unused")


def test_fault_injection_simulates_out_of_memory_above_its_pixel_budgets():
    engine = load(
        fault_injection={
            "out_of_memory_above_pixels": 64 * 64,
            "vae_out_of_memory_above_pixels": 64 * 64,
            "postprocess_out_of_memory_above_pixels": 64 * 64,
        }
    )
    (decoded,), _ = generate(engine, [spec()])
    assert len(decoded.images) == 1
    with pytest.raises(torch.OutOfMemoryError, match="simulated out of memory: 8192 pixels in one step"):
        generate(engine, [spec(), spec()])
    (job,) = engine.start([spec(images=2)])
    with pytest.raises(torch.OutOfMemoryError, match="8192 pixels in one VAE decode"):
        engine.decode(job.latents, 64, 64)
    made = engine.decode_later(job.latents, 64, 64, tiled=True).result()  # its postprocess: image by image
    assert len(made.decoded.images) == 2 and made.out_of_memory_retries == 1


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
def test_every_scheduler_runs_from_one_step_up_in_any_order(engine, scheduler):
    for steps in (1, 2, 5, 2):
        (decoded,), step_seconds = generate(engine, [spec(steps, scheduler)])
        assert decoded.images[0].size == (64, 64) and len(step_seconds) >= steps  # PNDM repeats one timestep
