"""A single-file checkpoint (A1111 / Civitai layout) served as it is, offline.

1. Read the header and detect the architecture and prediction type (``detect``).
2. Take the architecture's configs and tokenizers shipped in ``configs/`` and ``assets/`` (or
   ``handler.checkpoint.config``, a directory as diffusers' ``from_single_file(config=)`` takes).
3. Convert each component's weights with diffusers' own single-file converters, checking every
   weight against the model before any is loaded; take text encoders the file lacks (SD 3.x files
   often ship without) from ``handler.checkpoint.text_encoders``. No Hub, no download.
"""

from __future__ import annotations

import inspect
import itertools
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diffusers
import torch
from accelerate import init_empty_weights
from diffusers.loaders.single_file_utils import (
    DIFFUSERS_TO_LDM_MAPPING,
    LDM_CONTROLNET_KEY,
    convert_controlnet_checkpoint,
    convert_ldm_unet_checkpoint,
    convert_ldm_vae_checkpoint,
    convert_open_clip_checkpoint,
    convert_sd3_transformer_checkpoint_to_diffusers,
)
from torch import nn
from transformers import AutoTokenizer, CLIPTextModel, CLIPTextModelWithProjection, PretrainedConfig, T5EncoderModel

from handler.checkpoints.detect import UNET, Detected, TextEncoder, detect, prediction_of_yaml
from handler.checkpoints.files import PICKLE_SUFFIXES, CheckpointError, Header, read_header, read_tensors
from handler.checkpoints.tokenizers import clip_tokenizer, t5_tokenizer
from handler.config import CheckpointSettings

logger = logging.getLogger(__name__)

SHIPPED_CONFIGS = Path(__file__).parent / "configs"
VAE_PREFIXES = ("first_stage_model.", "vae.")  # where LDM files keep the VAE (diffusers' LDM_VAE_KEYS)
# SD 2.x: the 768-v models are the v-prediction ones (2.0-v, 2.1), the base models (512) predict noise.
SD2_SAMPLE_SIZE = {"v_prediction": 96, "epsilon": 64}
WITHOUT_SAFETY_CHECKER = {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}
TEXT_ENCODER_CLASSES: dict[str, Any] = {
    "CLIPTextModel": CLIPTextModel,
    "CLIPTextModelWithProjection": CLIPTextModelWithProjection,
    "T5EncoderModel": T5EncoderModel,
}


def shipped_config(architecture: str, component: str) -> dict[str, Any]:
    """A shipped architecture's component config (``configs/<architecture>/<component>/``)."""
    folder = SHIPPED_CONFIGS / architecture / component
    return json.loads(next(folder.glob("*config.json")).read_text())


def checkpoint_file(source: Path) -> Path | None:
    """The single-file checkpoint ``source`` names: the file itself, or the one ``.safetensors``
    file of a directory without ``model_index.json`` (an archive packages a file so); None for a
    diffusers directory."""
    if source.is_file():
        return source
    if not source.exists():
        if source.suffix.lower() in {".safetensors", *PICKLE_SUFFIXES}:
            raise CheckpointError(f"{source}: no such checkpoint file")
        return None  # a hub id
    if (source / "model_index.json").exists():
        return None
    files = sorted(source.glob("*.safetensors"))
    if len(files) != 1:
        found = ", ".join(path.name for path in files[:5]) or "no .safetensors file"
        raise CheckpointError(
            f"{source}: neither a diffusers directory (no model_index.json) nor one checkpoint ({found}); name "
            "the file itself"
        )
    return files[0]


def load_single_file(path: Path, settings: CheckpointSettings, dtype: torch.dtype, text_encoder_3: bool = True) -> Any:
    """The pipeline of the checkpoint at ``path`` (``text_encoder_3`` false: SD 3.x without T5).
    Raises ``CheckpointError`` naming the file and what is wrong with it."""
    # 1. What the file is, from its header.
    header = read_header(path)
    prediction, why = settings.prediction(), "handler.checkpoint.prediction_type"
    if prediction is None:
        prediction, why = prediction_of_yaml(path)
    # Given configs carry their scheduler's prediction type: only an explicit one replaces it.
    detected = detect(header, prediction, why, guess=settings.config is None)
    # 2. Its configs, and where each text encoder comes from, each checked against its tokenizer.
    configs = Path(settings.config) if settings.config else SHIPPED_CONFIGS / detected.configs
    index = _index(configs)
    encoders = _text_encoder_sources(header, detected, settings, text_encoder_3)
    tokenizers = {encoder.tokenizer: _tokenizer(source or configs, encoder) for encoder, source in encoders.items()}
    for encoder, source in encoders.items():
        if source is None:
            _check_vocabulary(header, encoder, tokenizers[encoder.tokenizer])
    # 3. The weights, converted and checked component by component.
    used = (UNET, *VAE_PREFIXES, *(encoder.prefix for encoder, source in encoders.items() if source is None))
    components = _Components(read_tensors(path, used), configs, dtype, path.name)
    vae_config = diffusers.AutoencoderKL.load_config(configs, subfolder="vae")
    loaded: dict[str, Any] = {"vae": components.vae(vae_config), "scheduler": _scheduler(configs, index, detected)}
    if detected.architecture == "sd3":
        loaded["transformer"] = components.transformer()
    else:
        loaded["unet"] = components.unet(_unet_overrides(configs, detected))
    for encoder, source in encoders.items():
        model_class = _encoder_class(configs, index, encoder)
        loaded[encoder.component] = (
            components.text_encoder(encoder, model_class)
            if source is None
            else model_class.from_pretrained(source, subfolder=encoder.component, dtype=dtype, use_safetensors=True)
        )
    loaded |= tokenizers
    if detected.architecture == "sd3" and not text_encoder_3:
        loaded |= {"text_encoder_3": None, "tokenizer_3": None}
    pipeline_class = getattr(diffusers, index["_class_name"])
    accepted = set(inspect.signature(pipeline_class.__init__).parameters)
    pipeline = pipeline_class(**loaded, **{k: v for k, v in WITHOUT_SAFETY_CHECKER.items() if k in accepted})
    _log(path, header, detected, configs, loaded, encoders)
    return pipeline


def load_vae_file(path: Path, config: dict[str, Any], dtype: torch.dtype) -> nn.Module:
    """The VAE in the file at ``path`` (A1111's ``models/VAE``), built with ``config``; refused as
    a checkpoint is, naming the file and the first weight that does not fit."""
    header = read_header(path)
    if not any(key.startswith(("encoder.", "decoder.", "first_stage_model.", "vae.")) for key in header.shapes):
        raise CheckpointError(f"{path.name}: not a VAE (no encoder or decoder weights)")
    vae = _Components(read_tensors(path, ("",)), path.parent, dtype, path.name).vae(config)
    logger.info(
        "vae file %s: %s in the file, %s loaded", path.name, header.dtypes_under(""), str(dtype).removeprefix("torch.")
    )
    return vae


def load_controlnet_file(path: Path, unet: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The ControlNet in the file at ``path`` (A1111's ``models/ControlNet``: LDM keys, under
    ``control_model.`` or none, or diffusers' keys), built as ``unet``'s ControlNet
    (``ControlNetModel.from_unet``) with the file's conditioning embedding; refused as a checkpoint
    is, naming the file and the first weight that does not fit (another family's, a small or mid
    variant)."""
    header = read_header(path)
    hint = _hint_convolutions(header)
    if not hint:
        raise CheckpointError(
            f"{path.name}: not a ControlNet (no conditioning embedding: input_hint_block or "
            "controlnet_cond_embedding weights); T2I-Adapters and control LoRAs are not served"
        )
    _refuse_global_pooling(path)
    prefix = LDM_CONTROLNET_KEY if header.has(LDM_CONTROLNET_KEY) else ""  # not an SD model saved beside it
    net = _Components(read_tensors(path, (prefix,)), path.parent, dtype, path.name).controlnet(unet, hint)
    logger.info(
        "controlnet file %s: %s in the file, %s loaded",
        path.name,
        header.dtypes_under(""),
        str(dtype).removeprefix("torch."),
    )
    return net


def _refuse_global_pooling(path: Path) -> None:
    """Refuse a ControlNet whose A1111 ``.yaml`` beside it asks for global average pooling (shuffle:
    diffusers' guess mode, not served), which its weights do not tell."""
    settings = path.with_suffix(".yaml")
    if not settings.is_file():
        return
    try:
        text = settings.read_text(errors="replace")
    except OSError as error:
        raise CheckpointError(f"{settings.name}: cannot be read ({error})") from error
    if re.search(r"global_average_pooling:\s*true", text, re.IGNORECASE):
        raise CheckpointError(
            f"{path.name}: a global-pooling ControlNet (its {settings.name} sets global_average_pooling); "
            "guess-mode ControlNets are not served"
        )


def _hint_convolutions(header: Header) -> list[tuple[int, ...]]:
    """The shapes of the conditioning embedding's convolutions, in order (its last: to the UNet's
    channels), in either layout; none where they are no such chain (an input convolution, pairs of
    blocks, an output one: an even count of at least 4, each taking the previous one's channels)."""
    pattern = re.compile(rf"^(?:{re.escape(LDM_CONTROLNET_KEY)})?input_hint_block\.(\d+)\.weight$")
    ldm = sorted((int(match[1]), shape) for name, shape in header.shapes.items() if (match := pattern.match(name)))
    blocks = re.compile(r"^controlnet_cond_embedding\.blocks\.(\d+)\.weight$")
    inner = sorted((int(match[1]), shape) for name, shape in header.shapes.items() if (match := blocks.match(name)))
    ends = [header.shapes.get(f"controlnet_cond_embedding.conv_{end}.weight") for end in ("in", "out")]
    if ldm:
        convolutions = [shape for _, shape in ldm]
    elif ends[0] is not None and ends[1] is not None:
        convolutions = [ends[0], *(shape for _, shape in inner), ends[1]]
    else:
        return []
    chained = all(len(shape) == 4 for shape in convolutions) and all(
        after[1] == before[0] for before, after in itertools.pairwise(convolutions)
    )
    return convolutions if chained and len(convolutions) >= 4 and len(convolutions) % 2 == 0 else []


def _converted_controlnet(checkpoint: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """diffusers' ControlNet converter, plus SDXL's added-conditions embedding (``label_emb``), which
    it leaves out; what it finds no weight for is left out too (refused as missing)."""
    state = convert_controlnet_checkpoint(checkpoint, config)
    if "time_embedding.linear_1.weight" not in checkpoint:
        inner = {key.removeprefix(LDM_CONTROLNET_KEY): value for key, value in checkpoint.items()}
        added: dict[str, str] = DIFFUSERS_TO_LDM_MAPPING["controlnet"]["addition_embed_type"]  # type: ignore[index]
        for ours, theirs in added.items():
            if theirs in inner:
                state[ours] = inner[theirs]
    return {key: value for key, value in state.items() if value is not None}


def _index(configs: Path) -> dict[str, Any]:
    """The configs' ``model_index.json``, each component it names checked to have its folder."""
    try:
        index = json.loads((configs / "model_index.json").read_text())
        missing = [
            name
            for name, value in index.items()
            if isinstance(value, list) and value[0] and not (configs / name).is_dir()
        ]
    except (OSError, ValueError, AttributeError, TypeError) as error:
        raise CheckpointError(f"handler.checkpoint.config {configs}: no readable model_index.json ({error})") from error
    if missing:
        raise CheckpointError(
            f"handler.checkpoint.config {configs}: model_index.json names {missing} without their folders"
        )
    return index


def _encoder_class(configs: Path, index: dict[str, Any], encoder: TextEncoder) -> Any:
    """The text encoder's class as the configs name it: one of ``TEXT_ENCODER_CLASSES``."""
    named = (index.get(encoder.component) or [None, None])[1]
    if named not in TEXT_ENCODER_CLASSES:
        raise CheckpointError(
            f"handler.checkpoint.config {configs}: {encoder.component} is {named!r}; "
            f"served: {sorted(TEXT_ENCODER_CLASSES)}"
        )
    return TEXT_ENCODER_CLASSES[named]


def _text_encoder_sources(
    header: Header, detected: Detected, settings: CheckpointSettings, text_encoder_3: bool
) -> dict[TextEncoder, Path | None]:
    """Each text encoder served and where it comes from: None, the file; else the directory of
    ``handler.checkpoint.text_encoders``. A text encoder neither has is refused, naming it."""
    sources: dict[TextEncoder, Path | None] = {}
    for encoder in detected.text_encoders:
        if encoder.layout == "t5" and not text_encoder_3:
            continue
        if header.has(encoder.prefix):
            sources[encoder] = None
        elif settings.text_encoders and (Path(settings.text_encoders) / encoder.component).is_dir():
            sources[encoder] = Path(settings.text_encoders)
        else:
            extra = " or handler.text_encoder_3: false (serve without T5)" if encoder.layout == "t5" else ""
            where = (
                f"handler.checkpoint.text_encoders ({settings.text_encoders}) has no {encoder.component}/"
                if settings.text_encoders
                else f"set handler.checkpoint.text_encoders to a {detected.name} diffusers directory holding it{extra}"
            )
            raise CheckpointError(
                f"{header.path.name}: {detected.name} without its {encoder.component} ({encoder.prefix.rstrip('.')}): "
                f"{where}"
            )
    return sources


def _unet_overrides(configs: Path, detected: Detected) -> dict[str, Any]:
    """SD 2.x's sample size by its prediction type, where the configs are the shipped ones."""
    if detected.architecture == "sd2" and detected.prediction and configs.is_relative_to(SHIPPED_CONFIGS):
        return {"sample_size": SD2_SAMPLE_SIZE[detected.prediction]}
    return {}


@dataclass
class _Components:
    """A checkpoint's components built from ``configs`` with their weights converted by diffusers'
    single-file converters."""

    checkpoint: dict[str, torch.Tensor]
    configs: Path
    dtype: torch.dtype
    name: str  # the file's, for refusals

    def unet(self, overrides: dict[str, Any]) -> nn.Module:
        model = self._empty(diffusers.UNet2DConditionModel, "unet", overrides)
        return self._fill(model, "unet", lambda: convert_ldm_unet_checkpoint(self.checkpoint, model.config))

    def transformer(self) -> nn.Module:
        model = self._empty(diffusers.SD3Transformer2DModel, "transformer", {})
        # The converter pops what it converts: give it the transformer's weights only.
        own = {key: value for key, value in self.checkpoint.items() if key.startswith(UNET)}
        return self._fill(model, "transformer", lambda: convert_sd3_transformer_checkpoint_to_diffusers(own))

    def text_encoder(self, encoder: TextEncoder, model_class: Any) -> nn.Module:
        config: PretrainedConfig = model_class.config_class.from_pretrained(self.configs / encoder.component)
        with init_empty_weights():
            model = model_class(config)

        def convert() -> dict[str, torch.Tensor]:
            if encoder.layout == "open_clip":
                state = convert_open_clip_checkpoint(model, self.checkpoint, prefix=encoder.prefix)
            else:
                state = {
                    key.removeprefix(encoder.prefix): value
                    for key, value in self.checkpoint.items()
                    if key.startswith(encoder.prefix)
                }
            if encoder.layout == "t5":
                return state
            # SD 3's CLIP-L file has no projection; diffusers' loader, too, gives it the identity.
            if hasattr(model, "text_projection") and not any("text_projection" in key for key in state):
                state["text_projection.weight"] = torch.eye(config.hidden_size)
            # transformers 5 flattened CLIPTextModel (no text_model); CLIPTextModelWithProjection keeps it.
            flat = not hasattr(model, "text_model")
            return {
                key.removeprefix("text_model.")
                if flat
                else ("" if key.startswith(("text_model.", "text_projection")) else "text_model.") + key: value
                for key, value in state.items()
            }

        return self._fill(model, encoder.component, convert)

    def _empty(self, model_class: Any, component: str, overrides: dict[str, Any]) -> nn.Module:
        config = {**model_class.load_config(self.configs, subfolder=component), **overrides}
        with init_empty_weights():
            return model_class.from_config(config)

    def vae(self, config: dict[str, Any]) -> nn.Module:
        """A VAE of ``config`` with this file's weights: LDM's (under ``first_stage_model.``, or
        without that prefix in a VAE file) or diffusers' keys."""
        with init_empty_weights():
            model = diffusers.AutoencoderKL.from_config(config)
        if any(key.startswith(("encoder.down_blocks.", "decoder.up_blocks.")) for key in self.checkpoint):
            return self._fill(model, "vae", lambda: self.checkpoint)
        return self._fill(model, "vae", lambda: convert_ldm_vae_checkpoint(self.checkpoint, model.config))

    def controlnet(self, unet: nn.Module, hint: list[tuple[int, ...]]) -> nn.Module:
        """``unet``'s ControlNet with this file's weights, its conditioning embedding's channels
        those of ``hint`` (the embedding's convolutions: the out channels of every other one)."""
        channels = tuple(shape[0] for shape in hint[:-1:2])
        with init_empty_weights():
            model = diffusers.ControlNetModel.from_unet(
                unet,
                conditioning_embedding_out_channels=channels,
                conditioning_channels=hint[0][1],
                load_weights_from_unet=False,
            )
        return self._fill(model, "ControlNet", lambda: self._controlnet_state(model))

    def _controlnet_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The file's ControlNet weights converted, refused where some are left over (a variant with
        more: ControlNet-Union, or another)."""
        state = _converted_controlnet(self.checkpoint, model.config)
        used = {id(state[key]) for key in model.state_dict() if key in state}
        left = sorted(key for key, value in self.checkpoint.items() if id(value) not in used)
        if left:
            raise CheckpointError(
                f"{len(left)} weights no ControlNet of this model has, such as {', '.join(left[:3])} "
                "(a ControlNet-Union or another variant?)"
            )
        return state

    def _fill(self, model: nn.Module, component: str, convert: Callable[[], dict[str, torch.Tensor]]) -> nn.Module:
        """``model`` (its parameters on the meta device) given the converted weights, each checked
        first: the first one missing or of another shape refuses the file, naming it."""
        try:
            state = convert()
        except (KeyError, IndexError, ValueError, RuntimeError) as error:
            raise CheckpointError(
                f"{self.name}: its {component} weights do not fit the model ({type(error).__name__}: {error})"
            ) from error
        expected = model.state_dict()
        for key, tensor in expected.items():
            if key not in state:
                raise CheckpointError(f"{self.name}: {component} weight {key} is missing from the file")
            if tuple(state[key].shape) != tuple(tensor.shape):
                raise CheckpointError(
                    f"{self.name}: {component} weight {key} has shape {tuple(state[key].shape)}, "
                    f"the model's is {tuple(tensor.shape)}"
                )
        model.load_state_dict({key: state[key].to(self.dtype) for key in expected}, assign=True)
        return model.eval()


def _tokenizer(directory: Path, encoder: TextEncoder) -> Any:
    """The tokenizer of ``directory`` (the configs, or where the text encoder comes from) where it
    has one, else the shipped one (CLIP's or T5's)."""
    folder = directory / encoder.tokenizer
    if folder.is_dir():
        return AutoTokenizer.from_pretrained(folder)
    return t5_tokenizer() if encoder.layout == "t5" else clip_tokenizer(encoder.pad_token)


def _check_vocabulary(header: Header, encoder: TextEncoder, tokenizer: Any) -> None:
    """Refuse a text encoder whose token embeddings do not fit the tokenizer, naming both sizes
    (T5 pads its embedding table past its vocabulary: it must hold the tokenizer's)."""
    embedding = next(
        (
            shape
            for key, shape in header.shapes.items()
            if key.startswith(encoder.prefix) and key.endswith(("token_embedding.weight", "shared.weight"))
        ),
        None,
    )
    if embedding is None or len(embedding) != 2:
        return  # a weight of another shape is refused, named, when the text encoder is loaded
    fits = embedding[0] >= len(tokenizer) if encoder.layout == "t5" else embedding[0] == len(tokenizer)
    if not fits:
        raise CheckpointError(
            f"{header.path.name}: {encoder.component} embeds {embedding[0]} tokens, its tokenizer has {len(tokenizer)} "
            "(give the model's own tokenizer in handler.checkpoint.config)"
        )


def _scheduler(configs: Path, index: dict, detected: Detected) -> Any:
    scheduler_class = getattr(diffusers, index["scheduler"][1])
    config = scheduler_class.load_config(configs, subfolder="scheduler")
    if detected.prediction is not None:
        config = {**config, "prediction_type": detected.prediction}
    return scheduler_class.from_config(config)


def _log(
    path: Path,
    header: Header,
    detected: Detected,
    configs: Path,
    loaded: dict[str, Any],
    encoders: dict[TextEncoder, Path | None],
) -> None:
    denoiser = "transformer" if "transformer" in loaded else "unet"
    stored = {denoiser: header.dtypes_under(UNET), "vae": header.dtypes_under("first_stage_model.")}
    stored |= {
        encoder.component: header.dtypes_under(encoder.prefix) if source is None else f"({source})"
        for encoder, source in encoders.items()
    }
    precision = " ".join(
        f"{component}={kept}->{str(loaded[component].dtype).removeprefix('torch.')}"
        for component, kept in stored.items()
    )
    prediction = getattr(loaded["scheduler"].config, "prediction_type", None) or "flow matching"
    logger.info(
        "single file %s: %s (%s); prediction_type=%s (%s); configs=%s; precision (file->loaded): %s",
        path.name,
        detected.name,
        detected.architecture_why,
        prediction,
        detected.prediction_why,
        configs,
        precision,
    )
