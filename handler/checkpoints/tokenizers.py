"""The tokenizers of every family, built from vocabularies shipped with the handler (``assets/``):
CLIP's byte-pair vocabulary (SD 1.x, SD 2.x, SDXL, SD 3.x) and T5's (SD 3.x), so that a
single-file checkpoint needs no download."""

from __future__ import annotations

import functools
import gzip
import tempfile
from pathlib import Path

from transformers import CLIPTokenizer, T5Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

BPE_VOCABULARY = Path(__file__).parent / "assets" / "bpe_simple_vocab_16e6.txt.gz"
T5_TOKENIZER = Path(__file__).parent / "assets" / "t5_tokenizer.json.gz"
CLIP_MAX_LENGTH = 77


@functools.cache
def _vocabulary() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """CLIP's 49408 tokens and 48894 merges.
    # Copied from open_clip's SimpleTokenizer.__init__ (openai/CLIP's simple_tokenizer.py)"""
    lines = gzip.open(BPE_VOCABULARY).read().decode("utf-8").split("\n")
    merges = [(first, second) for first, second in (line.split() for line in lines[1 : 49152 - 256 - 2 + 1])]
    symbols = list(bytes_to_unicode().values())
    tokens = symbols + [symbol + "</w>" for symbol in symbols] + ["".join(merge) for merge in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {token: index for index, token in enumerate(tokens)}, merges


def clip_tokenizer(pad_token: str = "<|endoftext|>") -> CLIPTokenizer:
    """CLIP ViT-L/14's tokenizer (SD 1.x, SDXL's first); OpenCLIP's pads with ``!`` (SD 2.x, SDXL's second)."""
    vocabulary, merges = _vocabulary()
    return CLIPTokenizer(
        vocab=dict(vocabulary),
        merges=list(merges),  # type: ignore[arg-type]  # pairs, as transformers' own conversion passes them
        model_max_length=CLIP_MAX_LENGTH,
        pad_token=pad_token,
    )


def t5_tokenizer() -> T5Tokenizer:
    """T5 v1.1's tokenizer (32100 pieces; SD 3.x's third)."""
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "tokenizer.json"
        path.write_bytes(gzip.open(T5_TOKENIZER).read())
        return T5Tokenizer(tokenizer_file=str(path))
