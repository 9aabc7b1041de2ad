"""Generate tiny Stable Diffusion pipelines with random weights, one per family the engine serves.

Real architectures at small sizes, fixed seeds, no downloads, saved in diffusers format with
safetensors weights:

- ``sd1``: SD 1.x (CLIP tokenizer and text encoder, UNet2DConditionModel with cross-attention,
  AutoencoderKL downsampling 8x, DDIM, epsilon prediction), 64x64 images. Tests that need no image
  quality use it; ``train_default_model`` starts from it.
- ``sd2``: SD 2.x (linear-projection attention, GELU text encoder, DDIM with v-prediction like
  SD 2.1's 768 model), a larger native size than SD 1.x: 96x96.
- ``sdxl``: SDXL (two text encoders, the second with a projection for pooled embeddings, UNet with
  ``text_time`` added conditioning, Euler scheduler, VAE with ``force_upcast``), 64x64.
- ``sd1-safety``: ``sd1`` with a safety checker and its feature extractor, as real SD 1.5
  directories ship them. The checker is calibrated to flag one known image (the calibration
  request written to ``calibration.json``) and to pass images unlike it, so tests can see a flagged
  image next to an unflagged batchmate.
- ``sd3``: SD 3 Medium (``StableDiffusion3Pipeline``: CLIP-L and CLIP-G with projections, a T5
  encoder with a Unigram tokenizer built from a vocabulary list, an MMDiT ``SD3Transformer2DModel``
  with patch size 2, a 16-channel VAE with SD3's shift and scaling factors, flow matching with
  shift 3), 64x64 images.
- ``sd35``: SD 3.5 Medium's shape (MMDiT-X: RMS-norm on queries and keys, dual-attention layers),
  otherwise as ``sd3``.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    DDIMScheduler,
    DiffusionPipeline,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    LatentConsistencyModelPipeline,
    LCMScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker
from transformers import (
    CLIPConfig,
    CLIPImageProcessor,
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    CLIPVisionConfig,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

logger = logging.getLogger("make_tiny_model")

HIDDEN_SIZE = 32
FAMILIES = ("sd1", "sd2", "sdxl", "sd1-safety", "sd3", "sd35")
# The one image the sd1-safety checker flags: diffusers' own call with these arguments.
CALIBRATION = {"prompt": "flag this picture", "seed": 0, "num_inference_steps": 4, "width": 64, "height": 64}
CALIBRATION_FILE = "calibration.json"
# Cosine (after projecting out the direction all images share) above which the checker flags an
# image: the calibration image scores 1.0, unrelated images score well below (about 0.7 at most).
FLAG_THRESHOLD = 0.9
NEVER = 10.0  # a concept threshold no cosine reaches
# Pipeline arguments of a model that ships no safety checker.
WITHOUT_SAFETY_CHECKER = {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}
# SD 3's VAE has no quantization convolutions around its latent space.
SD3_VAE_CONVOLUTIONS = {"use_quant_conv": False, "use_post_quant_conv": False}
# The transformer size of every tiny CLIP model (text encoders and the safety checker's two towers).
TINY_CLIP = {"hidden_size": HIDDEN_SIZE, "intermediate_size": 64, "num_attention_heads": 4}


def build_tokenizer() -> CLIPTokenizer:
    """A byte-level CLIP tokenizer: every byte (and its end-of-word form) is a token, no merges."""
    symbols = list(bytes_to_unicode().values())
    tokens = symbols + [symbol + "</w>" for symbol in symbols] + ["<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(vocab={token: index for index, token in enumerate(tokens)}, merges=[], model_max_length=77)


def build_t5_tokenizer() -> T5Tokenizer:
    """A character-level T5 tokenizer: a Unigram model over printable ASCII and the word marker,
    built from a vocabulary list (no sentencepiece file, no download)."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(chr(code), -3.0) for code in range(33, 127)]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def _text_config(tokenizer: CLIPTokenizer, **overrides) -> CLIPTextConfig:
    return CLIPTextConfig(
        **TINY_CLIP,
        vocab_size=len(tokenizer),
        num_hidden_layers=5,
        max_position_embeddings=77,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **overrides,
    )


def _vae(**overrides) -> AutoencoderKL:
    """A VAE downsampling 8x to 4 latent channels; ``overrides`` change any of its settings."""
    config = {
        "in_channels": 3,
        "out_channels": 3,
        "block_out_channels": (16, 32, 64, 64),
        "down_block_types": ("DownEncoderBlock2D",) * 4,
        "up_block_types": ("UpDecoderBlock2D",) * 4,
        "latent_channels": 4,
        "norm_num_groups": 16,
        "sample_size": 64,
    }
    return AutoencoderKL(**{**config, **overrides})


def _ddim(**overrides) -> DDIMScheduler:
    return DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
        **overrides,
    )


def _unet(**config) -> UNet2DConditionModel:
    """Two UNet blocks (32 and 64 channels), cross-attention in the inner one; ``config`` adds the rest."""
    return UNet2DConditionModel(
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=2,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=32,
        **config,
    )


def _stable_diffusion(
    tokenizer: CLIPTokenizer, text_encoder: CLIPTextModel, unet: UNet2DConditionModel, scheduler: DDIMScheduler
) -> StableDiffusionPipeline:
    """A ``StableDiffusionPipeline`` without a safety checker (the VAE's weights are drawn here)."""
    return StableDiffusionPipeline(
        vae=_vae(),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        **WITHOUT_SAFETY_CHECKER,
    )


def build_pipeline(seed: int) -> StableDiffusionPipeline:
    """The SD 1.x pipeline with weights drawn from ``seed`` (the default model's architecture)."""
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    text_encoder = CLIPTextModel(_text_config(tokenizer))
    unet = _unet(sample_size=8, cross_attention_dim=HIDDEN_SIZE, attention_head_dim=8)
    return _stable_diffusion(tokenizer, text_encoder, unet, _ddim())


def build_sd2_pipeline(seed: int) -> StableDiffusionPipeline:
    """SD 2.x: v-prediction, linear-projection attention, a GELU text encoder, 96x96 native."""
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    unet = _unet(sample_size=12, cross_attention_dim=HIDDEN_SIZE, attention_head_dim=(2, 4), use_linear_projection=True)
    text_encoder = CLIPTextModel(_text_config(tokenizer, hidden_act="gelu"))
    return _stable_diffusion(tokenizer, text_encoder, unet, _ddim(prediction_type="v_prediction"))


def build_sdxl_pipeline(seed: int) -> StableDiffusionXLPipeline:
    """SDXL: two text encoders (the second projects pooled embeddings), ``text_time`` conditioning
    of the UNet (pooled embeddings and six size/crop ids), Euler, a VAE that asks for float32."""
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    time_embed_dim = 8
    unet = _unet(
        sample_size=8,
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=time_embed_dim,
        transformer_layers_per_block=(1, 2),
        projection_class_embeddings_input_dim=6 * time_embed_dim + HIDDEN_SIZE,
        cross_attention_dim=2 * HIDDEN_SIZE,
    )
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1, timestep_spacing="leading"
    )
    return StableDiffusionXLPipeline(
        vae=_vae(force_upcast=True),
        text_encoder=CLIPTextModel(_text_config(tokenizer, hidden_act="gelu")),
        text_encoder_2=CLIPTextModelWithProjection(
            _text_config(tokenizer, hidden_act="gelu", projection_dim=HIDDEN_SIZE)
        ),
        tokenizer=tokenizer,
        tokenizer_2=build_tokenizer(),
        unet=unet,
        scheduler=scheduler,
        force_zeros_for_empty_prompt=True,
        add_watermarker=False,
    )


def build_sd3_pipeline(seed: int, **transformer: object) -> StableDiffusion3Pipeline:
    """SD 3: two CLIP encoders with projections (their pooled outputs joined are the pooled
    projection), a T5 encoder as wide as the transformer's joint attention, an MMDiT transformer,
    a 16-channel VAE with SD 3's shift and scaling factors and no quantization convolutions, and
    flow matching with shift 3; ``transformer`` adds to the transformer's configuration."""
    torch.manual_seed(seed)
    joint_width = 2 * HIDDEN_SIZE  # CLIP-L and CLIP-G side by side, padded to T5's width
    t5_tokenizer = build_t5_tokenizer()
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=len(t5_tokenizer),
            d_model=joint_width,
            d_kv=16,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            pad_token_id=t5_tokenizer.pad_token_id,
            eos_token_id=t5_tokenizer.eos_token_id,
        )
    )
    tokenizer = build_tokenizer()
    clip = [
        CLIPTextModelWithProjection(_text_config(tokenizer, hidden_act="gelu", projection_dim=HIDDEN_SIZE))
        for _ in range(2)
    ]
    settings = {"num_layers": 3, **transformer}
    return StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel(
            sample_size=8,
            patch_size=2,
            in_channels=16,
            out_channels=16,
            attention_head_dim=8,
            num_attention_heads=4,
            caption_projection_dim=HIDDEN_SIZE,
            joint_attention_dim=joint_width,
            pooled_projection_dim=2 * HIDDEN_SIZE,
            pos_embed_max_size=32,
            **settings,
        ),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_vae(
            latent_channels=16,
            shift_factor=0.0609,
            scaling_factor=1.5305,
            use_quant_conv=False,
            use_post_quant_conv=False,
        ),
        text_encoder=clip[0],
        tokenizer=tokenizer,
        text_encoder_2=clip[1],
        tokenizer_2=build_tokenizer(),
        text_encoder_3=t5,
        tokenizer_3=t5_tokenizer,
    )


def build_sd35_pipeline(seed: int) -> StableDiffusion3Pipeline:
    """SD 3.5 Medium's shape: MMDiT-X, with RMS-norm on queries and keys and dual-attention layers."""
    return build_sd3_pipeline(seed, qk_norm="rms_norm", dual_attention_layers=(0, 1))


def write_lcm_model(directory: Path, sd: StableDiffusionPipeline) -> None:
    """An LCM pipeline made of ``sd``'s components (a pipeline the step engine refuses), written to
    ``directory``."""
    LatentConsistencyModelPipeline(
        vae=sd.vae,
        text_encoder=sd.text_encoder,
        tokenizer=sd.tokenizer,
        unet=sd.unet,
        scheduler=LCMScheduler.from_config(sd.scheduler.config),
        **WITHOUT_SAFETY_CHECKER,
    ).save_pretrained(directory, safe_serialization=True)


def build_safety_checker() -> tuple[StableDiffusionSafetyChecker, CLIPImageProcessor]:
    """A tiny CLIP safety checker (32x32 input) that flags nothing until ``calibrate`` sets it."""
    vision = CLIPVisionConfig(**TINY_CLIP, num_hidden_layers=2, image_size=32, patch_size=4)
    text = CLIPTextConfig(
        **TINY_CLIP, num_hidden_layers=2, vocab_size=100, bos_token_id=0, eos_token_id=1, pad_token_id=1
    )
    checker = StableDiffusionSafetyChecker(
        CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=HIDDEN_SIZE)
    ).eval()
    extractor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return checker, extractor


@torch.no_grad()
def calibrate(
    pipeline: StableDiffusionPipeline, checker: StableDiffusionSafetyChecker, extractor: CLIPImageProcessor
) -> None:
    """Make ``checker`` flag the image of ``CALIBRATION`` (diffusers' own call) and pass others.

    A random CLIP maps every image to nearly the same direction, so the visual projection removes
    the direction shared by a set of reference images; concept 0 is the calibration image's
    projected embedding with threshold ``FLAG_THRESHOLD``, every other concept is never reached."""
    request = dict(CALIBRATION)
    seed = request.pop("seed")
    prompt = request.pop("prompt")
    references = [pipeline(prompt, generator=torch.Generator("cpu").manual_seed(seed), **request).images[0]]
    references += [
        pipeline(text, generator=torch.Generator("cpu").manual_seed(index), **request).images[0]
        for index, text in enumerate(["a red circle", "a blue square", "a green triangle", "noise"], start=1)
    ]
    pooled = checker.vision_model(extractor(references, return_tensors="pt").pixel_values)[1]
    shared = torch.nn.functional.normalize(pooled.mean(0), dim=0)
    checker.visual_projection.weight.copy_(torch.eye(HIDDEN_SIZE) - torch.outer(shared, shared))
    checker.concept_embeds[0] = checker.visual_projection(pooled[0])
    checker.concept_embeds_weights.fill_(NEVER)
    checker.concept_embeds_weights[0] = FLAG_THRESHOLD
    checker.special_care_embeds_weights.fill_(NEVER)


def build_safety_pipeline(seed: int) -> StableDiffusionPipeline:
    """``sd1`` with a calibrated safety checker and its feature extractor."""
    base = build_pipeline(seed)
    base.set_progress_bar_config(disable=True)
    checker, extractor = build_safety_checker()
    calibrate(base, checker, extractor)
    return StableDiffusionPipeline(
        vae=base.vae,
        text_encoder=base.text_encoder,
        tokenizer=base.tokenizer,
        unet=base.unet,
        scheduler=base.scheduler,
        safety_checker=checker,
        feature_extractor=extractor,
        requires_safety_checker=True,
    )


BUILDERS = {
    "sd1": build_pipeline,
    "sd2": build_sd2_pipeline,
    "sdxl": build_sdxl_pipeline,
    "sd1-safety": build_safety_pipeline,
    "sd3": build_sd3_pipeline,
    "sd35": build_sd35_pipeline,
}


def write(family: str, output: Path, seed: int = 0) -> DiffusionPipeline:
    """Build ``family`` and save it to ``output`` (safetensors)."""
    pipeline = BUILDERS[family](seed)
    pipeline.save_pretrained(output, safe_serialization=True)
    if family == "sd1-safety":
        (output / CALIBRATION_FILE).write_text(json.dumps(CALIBRATION, indent=2) + "\n")
    size = sum(f.stat().st_size for f in output.rglob("*") if f.is_file())
    logger.info("tiny %s pipeline (seed %d) written to %s (%.1f MB)", family, seed, output, size / 1e6)
    return pipeline


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "output", type=Path, nargs="+", help="directories to write the diffusers pipelines to (before --family)"
    )
    parser.add_argument(
        "--family", choices=FAMILIES, nargs="+", default=["sd1"], help="each output's family, in the same order"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args(argv)
    if len(args.family) != len(args.output):
        parser.error(f"{len(args.output)} outputs take {len(args.output)} families, one each; got {len(args.family)}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for output, family in zip(args.output, args.family, strict=True):  # one process: torch and diffusers imported once
        write(family, output, args.seed)


if __name__ == "__main__":
    main()
