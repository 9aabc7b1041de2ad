"""Write a published architecture with random weights once, as a diffusers directory the handler
loads like any local model (safetensors, float16); rewritten only when its recipe changes. What
``bench.sd15`` and ``bench.sdxl`` share: CLIP text configs around the byte-level tokenizer, the
writing, and their command line."""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from diffusers import DiffusionPipeline
from transformers import CLIPTextConfig, CLIPTokenizer

from handler.engine.loading import release_cached_memory

logger = logging.getLogger(__name__)

STAMP = "random-weights.json"


def ensure_pipeline(directory: Path, recipe: dict, build: Callable[[], DiffusionPipeline]) -> Path:
    """``build()``'s pipeline in ``directory`` unless the same ``recipe`` is already written there."""
    stamp = directory / STAMP
    recipe = json.loads(json.dumps(recipe))
    if stamp.is_file() and json.loads(stamp.read_text()) == recipe:
        return directory
    logger.info("building %s with random weights in %s (once)", directory.name, directory)
    build().to(torch.float16).save_pretrained(directory, safe_serialization=True)
    release_cached_memory()  # a pipeline drawn on the GPU (SD 3.5) leaves its blocks cached in this process
    stamp.write_text(json.dumps(recipe, indent=2))
    return directory


def without_vocabulary(config: dict) -> dict:
    """A shipped CLIP text config without what ``text_config`` sets around the tokenizer."""
    return {
        key: value
        for key, value in config.items()
        if key not in ("architectures", "vocab_size", "bos_token_id", "eos_token_id")
    }


def text_config(config: dict, tokenizer: CLIPTokenizer) -> CLIPTextConfig:
    """A published CLIP text encoder's ``config`` (CLIP's 49408-token vocabulary) around ``tokenizer``."""
    return CLIPTextConfig(
        vocab_size=49408,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **config,
    )


def main(ensure_model: Callable[[Path], Path], default_dir: Path, description: str) -> None:
    """``python -m bench.sd15 [DIR]`` and ``python -m bench.sdxl [DIR]``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("output", type=Path, nargs="?", default=default_dir)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logger.info("%s ready in %s", description, ensure_model(args.output))
