"""Single-file checkpoints (A1111 / ComfyUI / Civitai layout): every family's tiny pipeline written
as one original-layout file serves the same images as its directory (an SD 3.x file without its
text encoders, with them from a directory); what a file is and its prediction type are detected
from its header; files of other kinds, pickles, corrupt and mismatched files are refused at load,
naming the file and what is wrong."""

from __future__ import annotations

import logging
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from diffusers import AutoPipelineForText2Image
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from handler.checkpoints.detect import detect
from handler.checkpoints.files import CheckpointError, read_header
from handler.checkpoints.single_file import checkpoint_file, load_single_file
from handler.checkpoints.tokenizers import clip_tokenizer, t5_tokenizer
from handler.config import CheckpointSettings, HandlerSettings
from handler.engine.loading import load_engine
from model_making.single_file import vae_to_ldm, write_single_file
from server.paths import TINY_MODEL_DIRS
from tests.harness.engine_runs import assert_same_images, picture, run, spec, tiny_engine

FAMILIES = ("sd1", "sd2", "sdxl", "sd3", "sd35")
UNET = "model.diffusion_model."


def tiny_pipeline(family: str):
    return AutoPipelineForText2Image.from_pretrained(TINY_MODEL_DIRS[family], use_safetensors=True)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Each family's tiny pipeline as one file (SD 2.x's text encoder in OpenCLIP's layout)."""
    tmp = tmp_path_factory.mktemp("single-files")
    return {
        family: write_single_file(tiny_pipeline(family), tmp / f"tiny-{family}.safetensors", family == "sd2")
        for family in FAMILIES
    }


def checkpoint_settings(family: str | None = None, **more) -> CheckpointSettings:
    """Checkpoint settings with the family's tiny directory as configs (``None``: the shipped ones)."""
    return CheckpointSettings.model_validate({"config": family and str(TINY_MODEL_DIRS[family]), **more})


def file_engine(path: Path, family: str, vae: dict | None = None, **checkpoint):
    """An engine over a single file, the family's tiny directory giving configs (``checkpoint``: more settings)."""
    handler = {"model_path": str(path), "checkpoint": {"config": str(TINY_MODEL_DIRS[family]), **checkpoint}}
    return load_engine(HandlerSettings.model_validate(handler | ({"vae": vae} if vae else {})), "/unused")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_single_file_serves_the_images_of_its_directory(family, files, caplog):
    scheduler = "flow_match_euler" if family.startswith("sd3") else "ddim"
    jobs = [
        spec(seed=3, steps=4, scheduler=scheduler),
        spec("a blue square", seed=4, steps=3, image=picture(64), strength=0.6, scheduler=scheduler),
    ]
    with caplog.at_level(logging.INFO, logger="handler.checkpoints.single_file"):
        from_file = file_engine(files[family], family)
    from_directory = tiny_engine(family)
    plan = [(0, job) for job in jobs]
    for ours, theirs in zip(run(from_file, plan), run(from_directory, plan), strict=True):
        assert_same_images(ours, theirs, tolerance=0)
    prediction = from_directory.pipeline.scheduler.config.get("prediction_type")
    assert from_file.pipeline.scheduler.config.get("prediction_type") == prediction
    logged = caplog.text
    denoiser = "transformer" if family.startswith("sd3") else "unet"
    assert f"single file tiny-{family}.safetensors" in logged
    assert f"precision (file->loaded): {denoiser}=F32->float32" in logged


def test_a_directory_holding_one_checkpoint_is_that_checkpoint_and_a_diffusers_directory_is_not(files, tmp_path):
    packaged = tmp_path / "model"
    packaged.mkdir()
    (packaged / "x.safetensors").write_bytes(files["sd1"].read_bytes())
    assert checkpoint_file(packaged) == packaged / "x.safetensors"
    assert checkpoint_file(files["sd1"]) == files["sd1"]
    assert checkpoint_file(TINY_MODEL_DIRS["sd1"]) is None


def test_the_shipped_clip_tokenizer_gives_clips_own_ids():
    assert clip_tokenizer()("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]
    assert len(clip_tokenizer()) == 49408 and clip_tokenizer("!").pad_token_id == 0


def sd2_file(tmp: Path, bias_spread: float) -> Path:
    """Tiny SD 2.x written with its last attention norm's bias drawn at ``bias_spread``."""
    pipeline = tiny_pipeline("sd2")
    norm = pipeline.unet.up_blocks[-2].attentions[-1].transformer_blocks[0].norm1
    with torch.no_grad():
        norm.bias.copy_(torch.randn(norm.bias.shape, generator=torch.Generator().manual_seed(0)) * bias_spread)
    return write_single_file(pipeline, tmp / f"sd2-{bias_spread}.safetensors", open_clip_text_encoder=True)


def test_v_prediction_is_detected_from_the_norm_spread_a_yaml_beside_or_the_setting(tmp_path):
    v_shaped, base_shaped = sd2_file(tmp_path, 0.2), sd2_file(tmp_path, 0.02)
    assert detect(read_header(v_shaped)).prediction == "v_prediction"
    assert detect(read_header(base_shaped)).prediction == "epsilon"
    assert "spread 0.0" in detect(read_header(base_shaped)).prediction_why
    assert detect(read_header(v_shaped)).architecture == "sd2"
    # An A1111 .yaml beside the file, then the setting, win over the file.
    base_shaped.with_suffix(".yaml").write_text("model:\n  params:\n    parameterization: v\n")
    pipeline = load_single_file(base_shaped, checkpoint_settings("sd2"), torch.float32)
    assert pipeline.scheduler.config.prediction_type == "v_prediction"
    pipeline = load_single_file(base_shaped, checkpoint_settings("sd2", prediction_type="epsilon"), torch.float32)
    assert pipeline.scheduler.config.prediction_type == "epsilon"
    base_shaped.with_suffix(".yaml").write_text("model:\n  params:\n    parameterization: x0\n")
    with pytest.raises(CheckpointError, match="sd2-0.02.yaml: model.params.parameterization 'x0'; allowed: eps, v"):
        load_single_file(base_shaped, checkpoint_settings("sd2"), torch.float32)


def test_a_v_pred_marker_makes_any_unet_family_v_prediction(files, tmp_path):
    tensors = load_file(files["sdxl"]) | {"v_pred": torch.zeros(0)}
    save_file(tensors, tmp_path / "vpred.safetensors")
    assert detect(read_header(tmp_path / "vpred.safetensors")).prediction == "v_prediction"


def header_only(tmp: Path, name: str, shapes: dict[str, tuple[int, ...]]) -> Path:
    path = tmp / name
    save_file({key: torch.zeros(shape) for key, shape in shapes.items()}, path)
    return path


KINDS = {
    "flux.safetensors": ({"double_blocks.0.img_attn.qkv.weight": (2, 2)}, "a Flux checkpoint"),
    "inpaint.safetensors": ({UNET + "input_blocks.0.0.weight": (2, 9, 1, 1)}, "an inpainting UNet of 9 input channels"),
    "pix2pix.safetensors": ({UNET + "input_blocks.0.0.weight": (2, 8, 1, 1)}, "a UNet of 8 input channels"),
    "lora.safetensors": ({"lora_unet_down.lora_up.weight": (2, 2)}, r"no UNet .*a LoRA, VAE or text encoder file"),
    "refiner.safetensors": (
        {UNET + "input_blocks.0.0.weight": (2, 4, 1, 1), "conditioner.embedders.0.model.ln_final.weight": (2,)},
        "an SDXL refiner",
    ),
    "bare-unet.safetensors": ({UNET + "input_blocks.0.0.weight": (2, 4, 1, 1)}, "a UNet without its text encoder"),
    "flat-conv.safetensors": ({UNET + "input_blocks.0.0.weight": (4,)}, r".*weight has shape \(4,\), a convolution's"),
    "unclip.safetensors": (
        {
            UNET + "input_blocks.0.0.weight": (2, 4, 1, 1),
            UNET + "label_emb.0.0.weight": (2, 2),
            "cond_stage_model.model.ln_final.weight": (2,),
        },
        r"a UNet with added conditioning \(label_emb\) but not SDXL's two text encoders",
    ),
}


@pytest.mark.parametrize("name", KINDS)
def test_a_file_of_another_kind_is_refused_naming_what_it_is(name, tmp_path):
    shapes, refusal = KINDS[name]
    with pytest.raises(CheckpointError, match=f"{name}: {refusal}"):
        load_single_file(header_only(tmp_path, name, shapes), checkpoint_settings(), torch.float32)


def test_pickle_corrupt_and_absurd_files_are_refused_before_any_tensor_is_read(files, tmp_path):
    (tmp_path / "model.ckpt").write_bytes(b"\x80\x04")
    with pytest.raises(CheckpointError, match=r"model.ckpt: a pickle file \(.ckpt\); only .safetensors"):
        load_single_file(tmp_path / "model.ckpt", checkpoint_settings(), torch.float32)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(files["sd1"].read_bytes()[:-1000])
    header = b'{"w": {"dtype": "F32", "shape": [1000000000000], "data_offsets": [0, 4000000000000]}}'
    absurd = tmp_path / "absurd.safetensors"
    absurd.write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    for path in (truncated, absurd):
        with pytest.raises(CheckpointError, match=f"{path.name}: not a readable safetensors file"):
            load_single_file(path, checkpoint_settings(), torch.float32)


def test_a_file_that_does_not_fit_the_model_is_refused_naming_the_first_mismatch(files, tmp_path):
    tensors = load_file(files["sd1"])
    reshaped = dict(tensors) | {UNET + "out.2.bias": torch.zeros(5)}
    save_file(reshaped, tmp_path / "reshaped.safetensors")
    with pytest.raises(
        CheckpointError,
        match=r"reshaped.safetensors: unet weight conv_out.bias has shape \(5,\), the model's is \(4,\)",
    ):
        load_single_file(tmp_path / "reshaped.safetensors", checkpoint_settings("sd1"), torch.float32)
    missing = {key: value for key, value in tensors.items() if key != "first_stage_model.decoder.conv_out.weight"}
    save_file(missing, tmp_path / "missing.safetensors")
    with pytest.raises(CheckpointError, match="missing.safetensors: vae weight decoder.conv_out.weight is missing"):
        load_single_file(tmp_path / "missing.safetensors", checkpoint_settings("sd1"), torch.float32)


def test_a_text_encoder_that_does_not_fit_the_shipped_tokenizer_is_refused_naming_both_sizes(files):
    with pytest.raises(
        CheckpointError, match="tiny-sd1.safetensors: text_encoder embeds 514 tokens, its tokenizer has 49408"
    ):
        load_single_file(files["sd1"], checkpoint_settings(), torch.float32)


def test_an_sd3_file_without_its_text_encoders_takes_them_from_a_directory_or_is_refused_naming_them(tmp_path):
    pipeline = tiny_pipeline("sd35")
    bare = write_single_file(pipeline, tmp_path / "bare.safetensors", text_encoders=False)
    with pytest.raises(
        CheckpointError, match=r"bare.safetensors: SD 3.5 Medium without its text_encoder \(text_encoders.clip_l"
    ):
        load_single_file(bare, checkpoint_settings("sd35"), torch.float32)
    with pytest.raises(CheckpointError, match="text_encoders .* has no text_encoder/"):
        load_single_file(bare, checkpoint_settings("sd35", text_encoders=str(tmp_path)), torch.float32)
    from_file = file_engine(bare, "sd35", text_encoders=str(TINY_MODEL_DIRS["sd35"]))
    job = spec(seed=5, steps=3, scheduler="flow_match_euler")
    (ours,) = run(from_file, [(0, job)])
    (theirs,) = run(tiny_engine("sd35"), [(0, job)])
    assert_same_images(ours, theirs, tolerance=0)
    # Without T5 where the server is told to serve without it.
    without_t5 = load_single_file(
        bare, checkpoint_settings("sd35", text_encoders=str(TINY_MODEL_DIRS["sd35"])), torch.float32, False
    )
    assert without_t5.text_encoder_3 is None and without_t5.tokenizer_3 is None


def test_the_sd3_variants_are_told_apart_by_their_blocks(files):
    assert detect(read_header(files["sd3"])).name == "SD 3 Medium"
    assert detect(read_header(files["sd35"])).name == "SD 3.5 Medium"
    assert detect(read_header(files["sd35"])).configs == "sd35-medium"


def test_the_shipped_t5_tokenizer_gives_t5s_own_ids():
    assert t5_tokenizer()("a photo of a cat").input_ids == [3, 9, 1202, 13, 3, 9, 1712, 1]


def other_vae(family: str):
    """The family's tiny VAE with other weights: what a VAE file from models/VAE brings."""
    vae = tiny_pipeline(family).vae
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in vae.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.01)
    return vae


@pytest.mark.parametrize("layout", ["ldm", "diffusers"])
def test_a_vae_file_replaces_the_models_vae_for_a_directory_or_a_single_file(layout, files, tmp_path):
    vae = other_vae("sd1")
    weights = vae_to_ldm(vae.state_dict(), vae.config) if layout == "ldm" else vae.state_dict()
    save_file({key: value.contiguous() for key, value in weights.items()}, tmp_path / "other-vae.safetensors")
    job = spec(seed=6, steps=3, image=picture(64), strength=0.7)
    reference = tiny_engine("sd1")
    reference.pipeline.vae.load_state_dict(vae.state_dict())
    (expected,) = run(reference, [(0, job)])
    vae_setting = {"file": str(tmp_path / "other-vae.safetensors")}
    for engine in (tiny_engine("sd1", vae=vae_setting), file_engine(files["sd1"], "sd1", vae=vae_setting)):
        (ours,) = run(engine, [(0, job)])
        assert_same_images(ours, expected, tolerance=0)


def test_a_vae_file_that_does_not_fit_is_refused_naming_the_first_mismatch(files, tmp_path):
    save_file({"decoder.conv_out.weight": torch.zeros(3, 7, 3, 3)}, tmp_path / "odd-vae.safetensors")
    with pytest.raises(CheckpointError, match="odd-vae.safetensors: vae weight"):
        tiny_engine("sd1", vae={"file": str(tmp_path / "odd-vae.safetensors")})
    save_file({"lora_unet_x.lora_up.weight": torch.zeros(2, 2)}, tmp_path / "not-vae.safetensors")
    with pytest.raises(CheckpointError, match="not-vae.safetensors: not a VAE"):
        tiny_engine("sd1", vae={"file": str(tmp_path / "not-vae.safetensors")})


def test_a_vae_made_for_float16_is_served_without_the_upcast_when_told(tmp_path):
    vae = tiny_pipeline("sdxl").vae
    save_file(vae.state_dict(), tmp_path / "fp16-fix.safetensors")
    setting = {"file": str(tmp_path / "fp16-fix.safetensors")}
    assert tiny_engine("sdxl", vae=setting).pipeline.vae.config.force_upcast == vae.config.force_upcast
    engine = tiny_engine("sdxl", vae=setting | {"force_upcast": not vae.config.force_upcast})
    assert engine.pipeline.vae.config.force_upcast == (not vae.config.force_upcast)


@settings(max_examples=40)
@given(data=st.binary(max_size=300))
def test_any_bytes_are_refused_naming_the_file(data):
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "fuzzed.safetensors"
        path.write_bytes(data)
        with pytest.raises(CheckpointError, match="fuzzed.safetensors: "):
            load_single_file(path, checkpoint_settings("sd1"), torch.float32)


@settings(max_examples=30)
@given(drawn=st.data())
def test_a_file_of_the_right_names_and_wrong_shapes_is_refused_naming_the_file(files, drawn):
    """Names of a real checkpoint, a random subset of them with random small shapes: refused, never another error."""
    names = sorted(read_header(files["sd1"]).shapes)
    chosen = drawn.draw(st.lists(st.sampled_from(names), min_size=1, max_size=60, unique=True))
    shapes = st.lists(st.integers(0, 3), min_size=0, max_size=4).map(tuple)
    tensors = {name: torch.zeros(drawn.draw(shapes)) for name in chosen}
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "shapes.safetensors"
        save_file(tensors, path)
        with pytest.raises(CheckpointError, match="shapes.safetensors: "):
            load_single_file(path, checkpoint_settings("sd1"), torch.float32)


def test_a_yaml_without_a_parameterization_leaves_the_prediction_to_the_file(files, tmp_path):
    tensors = load_file(files["sdxl"]) | {"v_pred": torch.zeros(0)}
    marked = tmp_path / "marked.safetensors"
    save_file(tensors, marked)
    marked.with_suffix(".yaml").write_text("model:\n  target: sgm.models.diffusion.DiffusionEngine\n")
    pipeline = load_single_file(marked, checkpoint_settings("sdxl"), torch.float32)
    assert pipeline.scheduler.config.prediction_type == "v_prediction"  # the v_pred marker's
    marked.with_suffix(".yaml").write_text("model:\n  params:\n    denoiser_config:\n      target: sgm.VScaling\n")
    save_file(load_file(files["sdxl"]), marked)
    assert load_single_file(marked, checkpoint_settings("sdxl"), torch.float32).scheduler.config.prediction_type == (
        "v_prediction"
    )


def test_a_missing_file_or_a_folder_of_several_is_refused_naming_it(files, tmp_path):
    with pytest.raises(CheckpointError, match="absent.safetensors: no such checkpoint file"):
        checkpoint_file(tmp_path / "absent.safetensors")
    folder = tmp_path / "Stable-diffusion"
    folder.mkdir()
    for name in ("a", "b"):
        (folder / f"{name}.safetensors").write_bytes(files["sd1"].read_bytes())
    with pytest.raises(CheckpointError, match=r"nor one checkpoint \(a.safetensors, b.safetensors\); name the file"):
        checkpoint_file(folder)
    with pytest.raises(CheckpointError, match="handler.checkpoint.config .*: no readable model_index.json"):
        load_single_file(files["sd1"], CheckpointSettings(config=str(tmp_path)), torch.float32)
