"""Random-weight ControlNets for a pipeline directory, in diffusers' format (``config.json`` and
safetensors): the tests' ControlNets, one per UNet family's tiny model.

The ControlNet is ``ControlNetModel.from_unet`` of the model's UNet (so its residuals fit that
UNet), with every weight then drawn at random, the zero convolutions included (a fresh ControlNet's
residuals are all zero, which would make every parity test pass trivially), scaled so that it
visibly changes an image without swamping it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from diffusers import ControlNetModel, UNet2DConditionModel

# The conditioning embedding's channels: three stride-2 convolutions, 8x down as the VAE; the tiny
# models' narrow one, and SD 1.5 ControlNets' (diffusers' default).
SMALL_EMBEDDING = (8, 8, 16, 16)
SD_EMBEDDING = (16, 32, 96, 256)


def write_controlnet(
    model_dir: Path,
    output: Path,
    seed: int = 0,
    spread: float = 0.05,
    embedding: tuple[int, ...] = SMALL_EMBEDDING,
) -> Path:
    """A random ControlNet for the UNet in ``model_dir``, written to the directory ``output``;
    ``spread``: the standard deviation of the weights drawn for its output convolutions;
    ``embedding``: its conditioning embedding's channels."""
    torch.manual_seed(seed)
    unet = UNet2DConditionModel.from_pretrained(str(model_dir), subfolder="unet", use_safetensors=True)
    controlnet = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=embedding)
    with torch.no_grad():
        for name, parameter in controlnet.named_parameters():
            if name.startswith(("controlnet_down_blocks", "controlnet_mid_block", "controlnet_cond_embedding")):
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
