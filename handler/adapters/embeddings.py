"""Textual-inversion embeddings served from a directory by name, as A1111 uses them: a prompt or
negative prompt that names an embedding (its file stem, as a word, in any case) gets the
embedding's vectors where the name stands, through diffusers' ``load_textual_inversion``.

Files are read with ``safetensors`` only: A1111's (``emb_params``), diffusers' (one ``{token:
vectors}``) and SDXL's two-encoder files (``clip_l`` and ``clip_g``). Each loaded embedding gets a
token of its own (``<embedding3>``) that the prompt's name is replaced by before encoding, so a
changed file loads as a new token beside the old one and eviction never touches another's. A name
that is a word of the tokenizer's vocabulary (``cat``) would take that word from every prompt: it
is refused, named in the log, and not listed.

The text encoders run once per job, when it starts: an embedding is needed only until then, so
eviction keeps only those of the requests starting together.
"""

from __future__ import annotations

import functools
import itertools
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from handler.adapters.library import Entry, Kind, Library

logger = logging.getLogger(__name__)

EMBEDDINGS = Kind(
    "embedding", "embeddings", "handler.embeddings.dir (or $EMBEDDINGS_DIR)", "a file stem", suffix=".safetensors"
)
NAME_CHARACTERS = "A-Za-z0-9_.-"


@functools.cache
def _word(name: str) -> re.Pattern[str]:
    """``name`` as a word of a prompt, in any case (the CLIP tokenizers lower-case the text)."""
    return re.compile(rf"(?<![{NAME_CHARACTERS}]){re.escape(name)}(?![{NAME_CHARACTERS}])", re.IGNORECASE)


def rewrite(text: str, tokens: Mapping[str, str]) -> str:
    """``text`` with each embedding name it holds replaced by its loaded token."""
    for name, token in tokens.items():
        text = _word(name).sub(token, text)
    return text


class EmbeddingLibrary(Library):
    """The embeddings of one directory on one pipeline's tokenizers and text encoders."""

    kind = EMBEDDINGS

    def __init__(self, pipeline: Any, directory: Path | None, max_loaded: int, off_because: str | None = None):
        super().__init__(directory, max_loaded, off_because)
        self.pipeline = pipeline
        self._ids = (f"<embedding{index}>" for index in itertools.count())
        self._refused: set[str] = set()  # colliding names, logged once

    def encoders(self) -> list[tuple[Any, torch.nn.Module]]:
        """The (tokenizer, text encoder) pairs an embedding goes into: SDXL's two, else one."""
        pairs = [(self.pipeline.tokenizer, self.pipeline.text_encoder)]
        if getattr(self.pipeline, "text_encoder_2", None) is not None:
            pairs.append((self.pipeline.tokenizer_2, self.pipeline.text_encoder_2))
        return pairs

    def available(self) -> list[Entry]:
        """The entries whose names no word of the vocabulary takes."""
        return [entry for entry in super().available() if not self._collides(entry.name)]

    def _collides(self, name: str) -> bool:
        word = name.lower()
        if not any(word in vocabulary or f"{word}</w>" in vocabulary for vocabulary in self._vocabularies):
            return False
        if name not in self._refused:
            self._refused.add(name)
            logger.warning(
                "embedding %s refused: %r is a word of the model's vocabulary, and every prompt saying it would "
                "get the embedding; rename the file",
                name,
                word,
            )
        return True

    @functools.cached_property
    def _vocabularies(self) -> list[frozenset[str]]:
        """The tokenizers' own words, before any embedding was added."""
        return [frozenset(tokenizer.get_vocab()) for tokenizer, _ in self.encoders()]

    def named_in(self, text: str | None) -> list[str]:
        """The names of the served embeddings that ``text`` says, as words."""
        if not text:
            return []
        return [entry.name for entry in self.available() if _word(entry.name).search(text)]

    def acquire(self, names: Sequence[str], in_use: Iterable[str]) -> dict[str, str]:
        """Each name's token, loading the embeddings not in memory (or changed since), then evicting
        least recently used ones that ``in_use`` does not hold."""
        return dict(zip(names, self._acquire(names, in_use), strict=True))

    def _load(self, entry: Entry, keep: set[str]) -> str:
        token = next(self._ids)
        try:
            for (tokenizer, encoder), vectors in zip(
                self.encoders(), self._vectors(load_file(entry.path)), strict=True
            ):
                self.pipeline.load_textual_inversion(vectors, token=token, tokenizer=tokenizer, text_encoder=encoder)
        except Exception as error:  # safetensors, format and width errors alike
            self._forget(token)
            raise self.unloadable(entry, error) from None
        logger.info("embedding %s loaded as %s (%d bytes)", entry.name, token, entry.version[1])
        return token

    def _vectors(self, state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The vectors for each text encoder: SDXL's ``clip_l`` and ``clip_g``, else the file's one tensor."""
        if len(self.encoders()) == 2:
            if not {"clip_l", "clip_g"} <= state.keys():
                raise ValueError(f"an SDXL embedding holds clip_l and clip_g; this file holds {sorted(state)[:4]}")
            return [state["clip_l"], state["clip_g"]]
        if len(state) != 1:
            raise ValueError(
                f"an embedding holds one tensor (emb_params, or its token's); this file holds {len(state)}"
            )
        return list(state.values())

    def _forget(self, token: str) -> None:
        """The token and its extra vectors' tokens (``token_1``...) out of every tokenizer and text encoder."""
        own = re.compile(re.escape(token) + r"(_\d+)?")
        for tokenizer, encoder in self.encoders():
            added = [added for added in tokenizer.get_added_vocab() if own.fullmatch(added)]
            if added:
                self.pipeline.unload_textual_inversion(tokens=added, tokenizer=tokenizer, text_encoder=encoder)
