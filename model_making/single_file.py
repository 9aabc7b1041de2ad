"""Diffusers pipelines written as single-file checkpoints in the original key layout (LDM's for the
UNet families, MMDiT's for SD 3.x), as A1111, ComfyUI and Civitai keep them: the inverse of
diffusers' own single-file converters, for any size (diffusers' ``scripts/convert_diffusers_to_
original_*`` hard-code SD's topology and have no SD 3.x counterpart)."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from diffusers import ControlNetModel, DiffusionPipeline
from safetensors.torch import save_file

RESNET_NAMES = (
    ("norm1", "in_layers.0"),
    ("conv1", "in_layers.2"),
    ("norm2", "out_layers.0"),
    ("conv2", "out_layers.3"),
    ("time_emb_proj", "emb_layers.1"),
    ("conv_shortcut", "skip_connection"),
)
UNET_FIXED = {
    "time_embedding.linear_1": "time_embed.0",
    "time_embedding.linear_2": "time_embed.2",
    "conv_in": "input_blocks.0.0",
    "conv_norm_out": "out.0",
    "conv_out": "out.2",
    "add_embedding.linear_1": "label_emb.0.0",
    "add_embedding.linear_2": "label_emb.0.2",
}


def _resnet(name: str) -> str:
    for diffusers_name, ldm_name in RESNET_NAMES:
        name = name.replace(diffusers_name, ldm_name)
    return name


def unet_to_ldm(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """A diffusers UNet's weights under their LDM names (``input_blocks``, ``middle_block``, ``output_blocks``)."""
    per_block = config["layers_per_block"] + 1
    up_attention = ["CrossAttn" in kind for kind in config.get("up_block_types", ())]  # a ControlNet has none
    out = {}
    for key, value in state.items():
        base, suffix = key.rsplit(".", 1)
        if base in UNET_FIXED:
            out[f"{UNET_FIXED[base]}.{suffix}"] = value
        elif match := re.fullmatch(r"down_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.*)", key):
            index = 1 + int(match[1]) * per_block + int(match[3])
            resnet = match[2] == "resnets"
            out[f"input_blocks.{index}.{0 if resnet else 1}.{_resnet(match[4]) if resnet else match[4]}"] = value
        elif match := re.fullmatch(r"down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.*)", key):
            out[f"input_blocks.{(int(match[1]) + 1) * per_block}.0.op.{match[2]}"] = value
        elif match := re.fullmatch(r"mid_block\.(resnets|attentions)\.(\d+)\.(.*)", key):
            resnet = match[1] == "resnets"
            out[f"middle_block.{2 * int(match[2]) if resnet else 1}.{_resnet(match[3]) if resnet else match[3]}"] = (
                value
            )
        elif match := re.fullmatch(r"up_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.*)", key):
            index = int(match[1]) * per_block + int(match[3])
            resnet = match[2] == "resnets"
            out[f"output_blocks.{index}.{0 if resnet else 1}.{_resnet(match[4]) if resnet else match[4]}"] = value
        elif match := re.fullmatch(r"up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.*)", key):
            block = int(match[1])
            out[
                f"output_blocks.{block * per_block + per_block - 1}.{2 if up_attention[block] else 1}.conv.{match[2]}"
            ] = value
        else:
            raise KeyError(key)
    return out


def vae_to_ldm(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """A diffusers VAE's weights under their LDM names (``encoder.down``, ``decoder.up`` reversed, ``mid``)."""
    levels = len(config["up_block_types"])
    out = {}
    for key, value in state.items():
        name = key.replace("conv_norm_out", "norm_out").replace("conv_shortcut", "nin_shortcut")
        name = re.sub(r"encoder\.down_blocks\.(\d+)\.resnets\.(\d+)", r"encoder.down.\1.block.\2", name)
        name = re.sub(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0", r"encoder.down.\1.downsample", name)
        name = re.sub(
            r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)",
            lambda m: f"decoder.up.{levels - 1 - int(m[1])}.block.{m[2]}",
            name,
        )
        name = re.sub(
            r"decoder\.up_blocks\.(\d+)\.upsamplers\.0", lambda m: f"decoder.up.{levels - 1 - int(m[1])}.upsample", name
        )
        name = re.sub(r"mid_block\.resnets\.(\d+)", lambda m: f"mid.block_{int(m[1]) + 1}", name)
        if "mid_block.attentions.0." in name:
            name = name.replace("mid_block.attentions.0.", "mid.attn_1.").replace("group_norm", "norm")
            for diffusers_name, ldm_name in (("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "proj_out")):
                name = name.replace(diffusers_name, ldm_name)
            value = value[:, :, None, None] if value.ndim == 2 else value
        out[name] = value
    return out


def clip_to_ldm(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers CLIP text model's weights as LDM files keep them (under ``text_model.``)."""
    return {("" if key.startswith("text_model.") else "text_model.") + key: value for key, value in state.items()}


def clip_to_open_clip(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers CLIP text model's weights in OpenCLIP's layout (fused q, k, v; ``resblocks``)."""
    state = {key.removeprefix("text_model."): value for key, value in state.items()}
    out = {
        "token_embedding.weight": state.pop("embeddings.token_embedding.weight"),
        "positional_embedding": state.pop("embeddings.position_embedding.weight"),
    }
    if "text_projection.weight" in state:
        out["text_projection"] = state.pop("text_projection.weight").T.contiguous()
    for suffix in ("weight", "bias"):
        out[f"ln_final.{suffix}"] = state.pop(f"final_layer_norm.{suffix}")
    layers = {key.split(".")[2] for key in state if key.startswith("encoder.layers.")}
    for layer in range(len(layers)):
        source, target = f"encoder.layers.{layer}.", f"transformer.resblocks.{layer}."
        for suffix in ("weight", "bias"):
            out[target + f"attn.in_proj_{suffix}"] = torch.cat(
                [state.pop(source + f"self_attn.{part}_proj.{suffix}") for part in "qkv"]
            )
            for ldm_name, name in (
                ("attn.out_proj", "self_attn.out_proj"),
                ("ln_1", "layer_norm1"),
                ("ln_2", "layer_norm2"),
                ("mlp.c_fc", "mlp.fc1"),
                ("mlp.c_proj", "mlp.fc2"),
            ):
                out[target + f"{ldm_name}.{suffix}"] = state.pop(source + f"{name}.{suffix}")
    if state:
        raise KeyError(f"not converted: {sorted(state)[:3]}")
    return out


def _swap_halves(weight: torch.Tensor) -> torch.Tensor:
    """Shift and scale swapped (diffusers' ``swap_scale_shift`` is its own inverse)."""
    first, second = weight.chunk(2, 0)
    return torch.cat([second, first], 0)


SD3_NAMES = (
    ("x_embedder.proj", "pos_embed.proj"),
    ("t_embedder.mlp.0", "time_text_embed.timestep_embedder.linear_1"),
    ("t_embedder.mlp.2", "time_text_embed.timestep_embedder.linear_2"),
    ("y_embedder.mlp.0", "time_text_embed.text_embedder.linear_1"),
    ("y_embedder.mlp.2", "time_text_embed.text_embedder.linear_2"),
    ("context_embedder", "context_embedder"),
    ("final_layer.linear", "proj_out"),
)
SD3_NORMS = (
    ("attn.norm_q", "x_block.attn.ln_q"),
    ("attn.norm_k", "x_block.attn.ln_k"),
    ("attn.norm_added_q", "context_block.attn.ln_q"),
    ("attn.norm_added_k", "context_block.attn.ln_k"),
    ("attn2.norm_q", "x_block.attn2.ln_q"),
    ("attn2.norm_k", "x_block.attn2.ln_k"),
)


def sd3_transformer_to_original(state: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """An SD 3.x transformer's weights under the original MMDiT names (``joint_blocks``; fused q, k, v)."""
    state = dict(state)
    take = state.pop
    out = {"pos_embed": take("pos_embed.pos_embed")}
    for suffix in ("weight", "bias"):
        for original, name in SD3_NAMES:
            out[f"{original}.{suffix}"] = take(f"{name}.{suffix}")
        out[f"final_layer.adaLN_modulation.1.{suffix}"] = _swap_halves(take(f"norm_out.linear.{suffix}"))
    for index in range(layers):
        block = f"transformer_blocks.{index}."
        x, context = f"joint_blocks.{index}.x_block.", f"joint_blocks.{index}.context_block."
        last = index == layers - 1
        for suffix in ("weight", "bias"):
            out[x + f"attn.qkv.{suffix}"] = torch.cat([take(block + f"attn.to_{part}.{suffix}") for part in "qkv"])
            out[context + f"attn.qkv.{suffix}"] = torch.cat(
                [take(block + f"attn.add_{part}_proj.{suffix}") for part in "qkv"]
            )
            out[x + f"attn.proj.{suffix}"] = take(block + f"attn.to_out.0.{suffix}")
            out[x + f"adaLN_modulation.1.{suffix}"] = take(block + f"norm1.linear.{suffix}")
            context_norm = take(block + f"norm1_context.linear.{suffix}")
            out[context + f"adaLN_modulation.1.{suffix}"] = _swap_halves(context_norm) if last else context_norm
            out[x + f"mlp.fc1.{suffix}"] = take(block + f"ff.net.0.proj.{suffix}")
            out[x + f"mlp.fc2.{suffix}"] = take(block + f"ff.net.2.{suffix}")
            if not last:  # the last block's context stream ends after its attention's input
                out[context + f"attn.proj.{suffix}"] = take(block + f"attn.to_add_out.{suffix}")
                out[context + f"mlp.fc1.{suffix}"] = take(block + f"ff_context.net.0.proj.{suffix}")
                out[context + f"mlp.fc2.{suffix}"] = take(block + f"ff_context.net.2.{suffix}")
            if block + f"attn2.to_q.{suffix}" in state:
                out[x + f"attn2.qkv.{suffix}"] = torch.cat(
                    [take(block + f"attn2.to_{part}.{suffix}") for part in "qkv"]
                )
                out[x + f"attn2.proj.{suffix}"] = take(block + f"attn2.to_out.0.{suffix}")
        for name, original in SD3_NORMS:
            if block + name + ".weight" in state:
                out[f"joint_blocks.{index}.{original}.weight"] = take(block + name + ".weight")
    if state:
        raise KeyError(f"not converted: {sorted(state)[:3]}")
    return out


def write_single_file(
    pipeline: DiffusionPipeline, path: Path, open_clip_text_encoder: bool = False, text_encoders: bool = True
) -> Path:
    """``pipeline`` (SD 1.x, SD 2.x, SDXL or SD 3.x) as one original-layout ``.safetensors`` file at
    ``path``; ``open_clip_text_encoder`` writes an SD 2.x text encoder as OpenCLIP
    (``cond_stage_model.model``); ``text_encoders`` false leaves SD 3.x's out, as some files do."""
    tensors = {
        f"first_stage_model.{k}": v for k, v in vae_to_ldm(pipeline.vae.state_dict(), pipeline.vae.config).items()
    }
    if "transformer" in pipeline.components:
        transformer = pipeline.transformer
        original = sd3_transformer_to_original(transformer.state_dict(), transformer.config.num_layers)
        tensors |= {f"model.diffusion_model.{k}": v for k, v in original.items()}
        for component, prefix in (
            ("text_encoder", "clip_l"),
            ("text_encoder_2", "clip_g"),
            ("text_encoder_3", "t5xxl"),
        ):
            encoder = getattr(pipeline, component)
            if text_encoders and encoder is not None:
                # T5 ties its input embeddings to shared: each is written as its own tensor.
                tensors |= {
                    f"text_encoders.{prefix}.transformer.{k}": v.clone() for k, v in encoder.state_dict().items()
                }
        return _save(tensors, path)
    tensors |= {
        f"model.diffusion_model.{k}": v
        for k, v in unet_to_ldm(pipeline.unet.state_dict(), pipeline.unet.config).items()
    }
    if getattr(pipeline, "text_encoder_2", None) is not None:
        tensors |= {
            f"conditioner.embedders.0.transformer.{k}": v
            for k, v in clip_to_ldm(pipeline.text_encoder.state_dict()).items()
        }
        tensors |= {
            f"conditioner.embedders.1.model.{k}": v
            for k, v in clip_to_open_clip(pipeline.text_encoder_2.state_dict()).items()
        }
    elif open_clip_text_encoder:
        tensors |= {
            f"cond_stage_model.model.{k}": v for k, v in clip_to_open_clip(pipeline.text_encoder.state_dict()).items()
        }
    else:
        tensors |= {
            f"cond_stage_model.transformer.{k}": v for k, v in clip_to_ldm(pipeline.text_encoder.state_dict()).items()
        }
    return _save(tensors, path)


def controlnet_to_ldm(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """A diffusers ControlNet's weights under their LDM names (``control_model.``: the UNet's encoder
    as ``unet_to_ldm`` names it, ``input_hint_block``, ``zero_convs``, ``middle_block_out``)."""
    blocks = sum(1 for key in state if re.fullmatch(r"controlnet_cond_embedding\.blocks\.\d+\.weight", key))
    hint = {"conv_in": 0, "conv_out": 2 * (blocks + 1)} | {f"blocks.{k}": 2 * (k + 1) for k in range(blocks)}
    out, encoder = {}, {}
    for key, value in state.items():
        base, suffix = key.rsplit(".", 1)
        if base.startswith("controlnet_cond_embedding."):
            out[f"input_hint_block.{hint[base.removeprefix('controlnet_cond_embedding.')]}.{suffix}"] = value
        elif match := re.fullmatch(r"controlnet_down_blocks\.(\d+)", base):
            out[f"zero_convs.{match[1]}.0.{suffix}"] = value
        elif base == "controlnet_mid_block":
            out[f"middle_block_out.0.{suffix}"] = value
        else:
            encoder[key] = value
    return {f"control_model.{key}": value for key, value in (out | unet_to_ldm(encoder, config)).items()}


def write_controlnet_file(controlnet_dir: Path, path: Path, ldm: bool = True) -> Path:
    """The ControlNet directory ``controlnet_dir`` as one ``.safetensors`` file at ``path``: LDM's keys
    (A1111's ``models/ControlNet``), or diffusers' own (``ldm`` false, as SDXL ControlNets ship)."""
    net = ControlNetModel.from_pretrained(str(controlnet_dir), use_safetensors=True)
    state = net.state_dict()
    return _save(controlnet_to_ldm(state, net.config) if ldm else state, path)


def _save(tensors: dict[str, torch.Tensor], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({key: value.contiguous() for key, value in tensors.items()}, path)
    return path
