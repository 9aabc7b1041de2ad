"""Random-weight LoRA adapters for a pipeline directory, in diffusers' LoRA format: the tests' LoRAs
(a tiny model's own, one per family) and the shapes a LoRA of another family has.

The adapter targets the attention projections of the denoiser (an SD 3.x transformer's joint
attention: the image and the text streams) and, where asked, of the CLIP text encoder(s), with both
LoRA matrices drawn at random (``init_lora_weights=False``) and scaled so that the adapter visibly
changes an image without swamping it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from diffusers import AutoPipelineForText2Image, StableDiffusion3Pipeline, StableDiffusionXLPipeline
from peft import LoraConfig, get_peft_model_state_dict

UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
TRANSFORMER_TARGETS = [*UNET_TARGETS, "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]


def _adapter(module: torch.nn.Module, targets: list[str], rank: int, spread: float) -> dict[str, torch.Tensor]:
    module.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=targets, init_lora_weights=False))
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if "lora_" in name:
                parameter.normal_(0.0, spread)
    return get_peft_model_state_dict(module)


def write_lora(model_dir: Path, output: Path, seed: int = 0, rank: int = 4, text_encoder: bool = True) -> Path:
    """A random LoRA for the pipeline in ``model_dir``, written to ``output`` (a .safetensors file)."""
    torch.manual_seed(seed)
    pipeline = AutoPipelineForText2Image.from_pretrained(str(model_dir), use_safetensors=True)
    if isinstance(pipeline, StableDiffusion3Pipeline):
        layers = {"transformer_lora_layers": _adapter(pipeline.transformer, TRANSFORMER_TARGETS, rank, 0.1)}
    else:
        layers = {"unet_lora_layers": _adapter(pipeline.unet, UNET_TARGETS, rank, 0.3)}
    if text_encoder:
        layers["text_encoder_lora_layers"] = _adapter(pipeline.text_encoder, TEXT_TARGETS, rank, 0.3)
        if isinstance(pipeline, (StableDiffusionXLPipeline, StableDiffusion3Pipeline)):
            layers["text_encoder_2_lora_layers"] = _adapter(pipeline.text_encoder_2, TEXT_TARGETS, rank, 0.3)
    output.parent.mkdir(parents=True, exist_ok=True)
    type(pipeline).save_lora_weights(output.parent, weight_name=output.name, safe_serialization=True, **layers)
    return output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("output", type=Path, help="the .safetensors file to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--denoiser-only", action="store_true", help="no text encoder layers")
    args = parser.parse_args()
    write_lora(args.model_dir, args.output, args.seed, args.rank, text_encoder=not args.denoiser_only)


if __name__ == "__main__":
    main()
