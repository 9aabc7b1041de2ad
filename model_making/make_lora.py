"""Random-weight LoRA adapters for a pipeline directory, in diffusers' LoRA format: the tests' LoRAs
(a tiny model's own, one per family) and the shapes a LoRA of another family has; and LyCORIS LoHa
and LoKr files made by the ``lycoris-lora`` package, with kohya's module names.

The adapter targets the denoiser's attention projections (an SD 3.x transformer's joint attention:
the image and the text streams) and, where asked, its feed-forward layers and convolutions (a UNet's
ResNet convs, a transformer's patch embedding: PEFT Conv2d LoRAs, as kohya's LoCon) and the CLIP
text encoder(s), with both LoRA matrices drawn at random (``init_lora_weights=False``) and scaled so
that the adapter visibly changes an image without swamping it.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoPipelineForText2Image, StableDiffusion3Pipeline, StableDiffusionXLPipeline
from diffusers.utils import convert_state_dict_to_kohya
from peft import LoraConfig, get_peft_model_state_dict
from safetensors.torch import save_file

ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]
UNET_TARGETS = {"attention": ATTENTION, "feed_forward": ["ff.net.0.proj", "ff.net.2"], "conv": ["conv1", "conv2"]}
TRANSFORMER_TARGETS = {
    "attention": [*ATTENTION, "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"],
    "feed_forward": ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"],
    "conv": ["pos_embed.proj"],
}
TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]
LAYERS = tuple(UNET_TARGETS)


def _adapter(module: torch.nn.Module, targets: list[str], rank: int, spread: float) -> dict[str, torch.Tensor]:
    module.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=targets, init_lora_weights=False))
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if "lora_" in name:
                parameter.normal_(0.0, spread)
    return get_peft_model_state_dict(module)


def write_lora(
    model_dir: Path,
    output: Path,
    seed: int = 0,
    rank: int = 4,
    text_encoder: bool = True,
    layers: Sequence[str] = ("attention",),
    spread: float | None = None,
    kohya: bool = False,
) -> Path:
    """A random LoRA for the pipeline in ``model_dir`` on the denoiser's ``layers`` (of ``LAYERS``;
    none: on the text encoders only), written to ``output`` (a .safetensors file); ``spread``: the
    matrices' standard deviation;
    ``kohya``: in kohya's format (A1111, ComfyUI; SD 1.x and 2.x), alphas half the ranks."""
    torch.manual_seed(seed)
    pipeline = AutoPipelineForText2Image.from_pretrained(str(model_dir), use_safetensors=True)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    if not layers:
        pass  # a LoRA of the text encoders only
    elif isinstance(pipeline, StableDiffusion3Pipeline):
        targets = [target for layer in layers for target in TRANSFORMER_TARGETS[layer]]
        parts["transformer_lora_layers"] = _adapter(pipeline.transformer, targets, rank, spread or 0.1)
    else:
        targets = [target for layer in layers for target in UNET_TARGETS[layer]]
        parts["unet_lora_layers"] = _adapter(pipeline.unet, targets, rank, spread or 0.3)
    if text_encoder:
        parts["text_encoder_lora_layers"] = _adapter(pipeline.text_encoder, TEXT_TARGETS, rank, 0.3)
        if isinstance(pipeline, (StableDiffusionXLPipeline, StableDiffusion3Pipeline)):
            parts["text_encoder_2_lora_layers"] = _adapter(pipeline.text_encoder_2, TEXT_TARGETS, rank, 0.3)
    output.parent.mkdir(parents=True, exist_ok=True)
    if kohya:
        if isinstance(pipeline, (StableDiffusionXLPipeline, StableDiffusion3Pipeline)):
            raise ValueError("kohya LoRAs are written for SD 1.x and 2.x models only")
        prefixed = {
            f"{part.removesuffix('_lora_layers')}.{key}": value
            for part, layer in parts.items()
            for key, value in layer.items()
        }
        state_dict = convert_state_dict_to_kohya(prefixed)
        save_file({key: value / 2 if key.endswith(".alpha") else value for key, value in state_dict.items()}, output)
        return output
    type(pipeline).save_lora_weights(output.parent, weight_name=output.name, safe_serialization=True, **parts)
    return output


def kohya_modules(pipeline: Any) -> Iterator[tuple[str, str, torch.nn.Module]]:
    """(kohya module name prefix, component, component module) for the UNet (``lora_unet``) and
    the CLIP text encoders (``lora_te``, SDXL's ``lora_te1`` and ``lora_te2``), whose module names
    kohya writes below ``text_model``."""
    yield "lora_unet_", "", pipeline.unet
    encoders = [pipeline.text_encoder] + (
        [pipeline.text_encoder_2] if getattr(pipeline, "text_encoder_2", None) else []
    )
    for index, encoder in enumerate(encoders, start=1):
        prefix = "lora_te" if len(encoders) == 1 else f"lora_te{index}"
        yield f"{prefix}_", "" if hasattr(encoder, "text_model") else "text_model_", encoder


def write_lycoris(
    model_dir: Path,
    output: Path,
    algo: str,
    seed: int = 0,
    dim: int = 2,
    alpha: float = 1.0,
    spread: float = 0.3,
    text_encoder: bool = True,
    only: str = "",
    **options: Any,
) -> Path:
    """A random LyCORIS file (``algo``: ``loha`` or ``lokr``) for the SD 1.x, 2.x or SDXL pipeline
    in ``model_dir``, made by ``lycoris.create_lycoris`` (its ``full`` preset: the UNet's attention,
    feed-forward and ResNet layers, the text encoders' attention and MLP; ``options``: its keyword
    arguments, ``use_tucker``, ``decompose_both``, ``factor``...), every factor drawn at random with
    standard deviation ``spread`` (LyCORIS starts one half at 0), written with kohya's module names;
    ``only``: the UNet's modules whose names hold it (``transformer_blocks``: attention and
    feed-forward layers)."""
    from lycoris import create_lycoris  # the tests' and benchmarks' LyCORIS files only

    torch.manual_seed(seed)
    pipeline = AutoPipelineForText2Image.from_pretrained(str(model_dir), use_safetensors=True)
    state: dict[str, torch.Tensor] = {}
    for prefix, infix, component in kohya_modules(pipeline):
        if prefix != "lora_unet_" and not text_encoder:
            continue
        network = create_lycoris(component, 1.0, linear_dim=dim, linear_alpha=alpha, algo=algo, **options)
        for module in network.loras:
            if "add_embedding" in module.lora_name:
                continue  # SDXL's added-conditions embedding: diffusers' kohya converter names no such layer
            if prefix == "lora_unet_" and only not in module.lora_name:
                continue
            with torch.no_grad():
                for name, parameter in module.named_parameters():
                    if not name.startswith("org_"):
                        parameter.normal_(0.0, spread)
            name = module.lora_name.removeprefix(f"{network.LORA_PREFIX}_")
            for key, value in module.custom_state_dict().items():
                state[f"{prefix}{infix}{name}.{key}"] = value.detach().contiguous()
    output.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, output)
    return output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("output", type=Path, help="the .safetensors file to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--denoiser-only", action="store_true", help="no text encoder layers")
    parser.add_argument("--layers", nargs="+", choices=LAYERS, default=["attention"], help="the denoiser's layers")
    parser.add_argument("--kohya", action="store_true", help="kohya's format (SD 1.x and 2.x)")
    args = parser.parse_args()
    write_lora(args.model_dir, args.output, args.seed, args.rank, not args.denoiser_only, args.layers, kohya=args.kohya)


if __name__ == "__main__":
    main()
