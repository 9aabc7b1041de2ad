"""Random-weight ControlNets for a pipeline directory, in diffusers' format (``config.json`` and
safetensors): the tests' ControlNets, for each family's tiny model.

For a UNet model the ControlNet is ``ControlNetModel.from_unet`` of its UNet (so its residuals fit
that UNet); for an SD 3.x model, an ``SD3ControlNetModel`` of the transformer's width and
conditioning with ``layers`` blocks, InstantX's kind (its own position embedding and context
embedder, zeroed pooled projections) or, with ``large``, SD 3.5 Large's (the transformer's position
embedding, no context embedder). Every weight is then drawn at random, the zero layers included (a
fresh ControlNet's residuals are all zero, which would make every parity test pass trivially),
scaled so that it visibly changes an image without swamping it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from diffusers import ControlNetModel, SD3ControlNetModel, UNet2DConditionModel

# The conditioning embedding's channels: three stride-2 convolutions, 8x down as the VAE; the tiny
# models' narrow one, and SD 1.5 ControlNets' (diffusers' default).
SMALL_EMBEDDING = (8, 8, 16, 16)
SD_EMBEDDING = (16, 32, 96, 256)
# What an SD 3.x ControlNet takes of the transformer's config.
TRANSFORMER_SETTINGS = (
    "sample_size",
    "patch_size",
    "in_channels",
    "attention_head_dim",
    "num_attention_heads",
    "joint_attention_dim",
    "caption_projection_dim",
    "pooled_projection_dim",
    "out_channels",
    "pos_embed_max_size",
    "qk_norm",
)


def write_controlnet(
    model_dir: Path,
    output: Path,
    seed: int = 0,
    spread: float = 0.05,
    embedding: tuple[int, ...] = SMALL_EMBEDDING,
    layers: int = 2,
    large: bool = False,
) -> Path:
    """A random ControlNet for the denoiser in ``model_dir``, written to the directory ``output``;
    ``spread``: the standard deviation of the weights drawn for its output layers; ``embedding``:
    a UNet ControlNet's conditioning embedding's channels; ``layers`` and ``large``: an SD 3.x
    ControlNet's blocks and kind."""
    torch.manual_seed(seed)
    if (model_dir / "transformer").is_dir():
        return _write_sd3_controlnet(model_dir, output, spread, layers, large)
    unet = UNet2DConditionModel.from_pretrained(str(model_dir), subfolder="unet", use_safetensors=True)
    controlnet = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=embedding)
    with torch.no_grad():
        for name, parameter in controlnet.named_parameters():
            if name.startswith(("controlnet_down_blocks", "controlnet_mid_block", "controlnet_cond_embedding")):
                parameter.normal_(0.0, spread if "weight" in name else spread / 10)
    controlnet.save_pretrained(str(output), safe_serialization=True)
    return output


def _write_sd3_controlnet(model_dir: Path, output: Path, spread: float, layers: int, large: bool) -> Path:
    config = json.loads((model_dir / "transformer" / "config.json").read_text())
    settings = {key: config[key] for key in TRANSFORMER_SETTINGS}
    settings["dual_attention_layers"] = [layer for layer in config["dual_attention_layers"] if layer < layers]
    if large:  # SD 3.5 Large's: single blocks on the transformer's position embedding, the prompt's pooled projections
        settings.update(joint_attention_dim=None, use_pos_embed=False, force_zeros_for_pooled_projection=False)
    controlnet = SD3ControlNetModel(num_layers=layers, **settings)
    with torch.no_grad():
        for name, parameter in controlnet.named_parameters():
            if name.startswith(("controlnet_blocks", "pos_embed_input")):
                parameter.normal_(0.0, spread if "weight" in name else spread / 10)
    controlnet.save_pretrained(str(output), safe_serialization=True)
    return output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("output", type=Path, help="the ControlNet directory to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--spread", type=float, default=0.05)
    arguments = parser.parse_args()
    write_controlnet(arguments.model_dir, arguments.output, arguments.seed, arguments.spread)


if __name__ == "__main__":
    main()
