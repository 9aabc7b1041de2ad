"""What a single-file checkpoint is, from its tensors' names and shapes (the header only), as
ComfyUI's ``detect_unet_config`` tells architectures apart; v-prediction from an A1111 ``.yaml``
beside the file, a setting, the file's ``v_pred`` marker, or for SD 2.x the spread of one norm's
bias as ComfyUI reads it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml

from handler.checkpoints.files import CheckpointError, Header

UNET = "model.diffusion_model."  # the denoiser's prefix, SD 3.x's transformer's too
Architecture = Literal["sd1", "sd2", "sdxl", "sd3"]
Prediction = Literal["epsilon", "v_prediction"]
# ComfyUI's threshold (model_detection.py): SD 2.x v-prediction models' last attention norm has a wider bias.
V_PREDICTION_BIAS_STD = 0.09


@dataclass(frozen=True)
class TextEncoder:
    """Where a text encoder's weights lie in the file, and in which layout."""

    component: str  # the pipeline's name for it: text_encoder, text_encoder_2, text_encoder_3
    prefix: str
    layout: Literal["clip", "open_clip", "t5"]  # open_clip: OpenCLIP's (fused attention projections)
    pad_token: str  # its tokenizer's padding token (CLIP's)

    @property
    def tokenizer(self) -> str:
        return self.component.replace("text_encoder", "tokenizer")


TEXT_ENCODERS: dict[Architecture, tuple[TextEncoder, ...]] = {
    "sd1": (TextEncoder("text_encoder", "cond_stage_model.transformer.", "clip", "<|endoftext|>"),),
    "sd2": (TextEncoder("text_encoder", "cond_stage_model.model.", "open_clip", "!"),),
    "sdxl": (
        TextEncoder("text_encoder", "conditioner.embedders.0.transformer.", "clip", "<|endoftext|>"),
        TextEncoder("text_encoder_2", "conditioner.embedders.1.model.", "open_clip", "!"),
    ),
    "sd3": (
        TextEncoder("text_encoder", "text_encoders.clip_l.transformer.", "clip", "<|endoftext|>"),
        TextEncoder("text_encoder_2", "text_encoders.clip_g.transformer.", "clip", "!"),
        TextEncoder("text_encoder_3", "text_encoders.t5xxl.transformer.", "t5", ""),
    ),
}


@dataclass(frozen=True)
class Detected:
    """A checkpoint's architecture and prediction type, and how each was told."""

    architecture: Architecture
    name: str  # SD 1.x, SD 2.x, SDXL base, SD 3 Medium, SD 3.5 Medium, SD 3.5 Large
    configs: str  # the shipped configs it loads with (configs/<configs>)
    architecture_why: str
    prediction: Prediction | None  # None: the configs' scheduler says
    prediction_why: str

    @property
    def text_encoders(self) -> tuple[TextEncoder, ...]:
        return TEXT_ENCODERS[self.architecture]


def detect(
    header: Header, prediction: Prediction | None = None, prediction_why: str = "", guess: bool = True
) -> Detected:
    """The architecture of the checkpoint ``header`` describes (refusing a kind this server does
    not serve, by name), and its prediction type: ``prediction`` where given (a setting or a
    ``.yaml``), else the file's ``v_pred`` marker, else (``guess``) SD 2.x's norm spread; None
    leaves it to the configs' scheduler."""
    architecture, name, configs, why = _architecture(header)
    if architecture == "sd3":  # flow matching: no prediction type to choose
        prediction, prediction_why = None, "flow matching"
    elif prediction is None:
        prediction, prediction_why = _prediction(header, architecture, guess)
    return Detected(architecture, name, configs, why, prediction, prediction_why)


def _architecture(header: Header) -> tuple[Architecture, str, str, str]:
    """The architecture, its name, its shipped configs' name, and why."""
    name = header.path.name
    if header.has("double_blocks.") or header.has(UNET + "double_blocks."):
        raise CheckpointError(f"{name}: a Flux checkpoint (double_blocks); served: SD 1.x, 2.x, SDXL base and SD 3.x")
    if header.has(UNET + "joint_blocks."):
        return _sd3(header)
    conv_in = header.shapes.get(UNET + "input_blocks.0.0.weight")
    if conv_in is None:
        raise CheckpointError(
            f"{name}: no UNet ({UNET}input_blocks.0.0.weight): not a Stable Diffusion checkpoint (a LoRA, VAE or "
            "text encoder file goes elsewhere)"
        )
    if len(conv_in) != 4:
        raise CheckpointError(f"{name}: {UNET}input_blocks.0.0.weight has shape {conv_in}, a convolution's has 4 axes")
    if conv_in[1] != 4:
        kind = "an inpainting UNet" if conv_in[1] == 9 else "a UNet"
        raise CheckpointError(
            f"{name}: {kind} of {conv_in[1]} input channels; served: text-to-image UNets of 4 (inpainting runs on "
            "them, with a mask)"
        )
    if header.has("conditioner.embedders.0.model.") and not header.has("conditioner.embedders.1."):
        raise CheckpointError(f"{name}: an SDXL refiner (one OpenCLIP text encoder); served: SDXL base")
    if header.has(UNET + "label_emb.0.0.weight"):
        if not header.has("conditioner.embedders.1."):
            raise CheckpointError(
                f"{name}: a UNet with added conditioning (label_emb) but not SDXL's two text encoders (an SD 2.x "
                "unCLIP?); served: SDXL base"
            )
        return "sdxl", "SDXL base", "sdxl", "added conditioning (label_emb) and two text encoders"
    if header.has("cond_stage_model.model."):
        return "sd2", "SD 2.x", "sd2", "an OpenCLIP text encoder (cond_stage_model.model)"
    if header.has("cond_stage_model.transformer."):
        return "sd1", "SD 1.x", "sd1", "a CLIP text encoder (cond_stage_model.transformer)"
    raise CheckpointError(
        f"{name}: a UNet without its text encoder (no cond_stage_model or conditioner weights); served: files with "
        "their text encoders"
    )


def _sd3(header: Header) -> tuple[Architecture, str, str, str]:
    """SD 3 Medium, SD 3.5 Medium (MMDiT-X: a second attention in its first blocks) or SD 3.5 Large
    (query-key norms, 38 blocks)."""
    blocks = {key.split(".")[3] for key in header.shapes if key.startswith(UNET + "joint_blocks.")}
    why = f"{len(blocks)} joint blocks"
    if header.has(UNET + "joint_blocks.0.x_block.attn2."):
        return "sd3", "SD 3.5 Medium", "sd35-medium", why + " with a second attention (MMDiT-X)"
    if any(".attn.ln_q." in key for key in header.shapes):
        return "sd3", "SD 3.5 Large", "sd35-large", why + " with query-key norms"
    return "sd3", "SD 3 Medium", "sd3-medium", why


def _prediction(header: Header, architecture: Architecture, guess: bool) -> tuple[Prediction | None, str]:
    if "v_pred" in header.shapes:
        return "v_prediction", "the file's v_pred marker"
    if architecture != "sd2" or not guess:
        return None, "the scheduler config"
    norm = _last_attention_norm_bias(header)
    spread = float(header.tensor(norm).float().std(unbiased=False))
    if spread > V_PREDICTION_BIAS_STD:
        return "v_prediction", f"{norm} spread {spread:.3f} > {V_PREDICTION_BIAS_STD}"
    return "epsilon", f"{norm} spread {spread:.3f} <= {V_PREDICTION_BIAS_STD}"


def _last_attention_norm_bias(header: Header) -> str:
    """The first transformer norm's bias of the UNet's last output block with attention
    (``output_blocks.11`` at SD 2.x's size, the one ComfyUI reads)."""
    pattern = re.compile(re.escape(UNET) + r"output_blocks\.(\d+)\.1\.transformer_blocks\.0\.norm1\.bias")
    found = [(int(match[1]), name) for name in header.shapes if (match := pattern.fullmatch(name))]
    if not found:
        raise CheckpointError(f"{header.path.name}: an SD 2.x UNet without attention in its output blocks")
    return max(found)[1]


def prediction_of_yaml(checkpoint: Path) -> tuple[Prediction | None, str]:
    """The prediction type an A1111 ``.yaml`` beside the checkpoint sets: LDM's
    ``model.params.parameterization`` (``v`` or ``eps``), or sgm's v-scaling denoiser (SDXL v
    models); None where there is no such file or it says neither."""
    path = checkpoint.with_suffix(".yaml")
    if not path.is_file():
        return None, ""
    try:
        text = path.read_text()
        config = yaml.safe_load(text)
        parameterization = ((config.get("model") or {}).get("params") or {}).get("parameterization")
    except (yaml.YAMLError, AttributeError, UnicodeDecodeError, OSError) as error:
        raise CheckpointError(f"{path.name}: not a readable LDM config ({error})") from error
    if parameterization is None:
        if "VScaling" in text:
            return "v_prediction", f"{path.name} (a v-scaling denoiser)"
        return None, ""
    if parameterization not in ("eps", "v"):
        raise CheckpointError(f"{path.name}: model.params.parameterization {parameterization!r}; allowed: eps, v")
    prediction: Prediction = "v_prediction" if parameterization == "v" else "epsilon"
    return prediction, f"{path.name} (parameterization: {parameterization})"
