"""Textual-inversion embeddings served from a directory by name, as A1111 uses them: a prompt or
negative prompt that names an embedding (its file stem, as a word, in any case) gets the
embedding's vectors where the name stands, through diffusers' ``load_textual_inversion``.

Files are read with ``safetensors`` only: A1111's (``emb_params``), diffusers' (one ``{token:
vectors}``) and SDXL's two-encoder files (``clip_l`` and ``clip_g``), their headers checked against
the text encoders first. Each loaded embedding gets a token of its own (random per worker) that the
prompt's name is replaced by before encoding, so a
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
import secrets
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from handler.adapters.library import Entry, Kind, Library
from handler.checkpoints.files import Header, read_header

logger = logging.getLogger(__name__)

EMBEDDINGS = Kind(
    "embedding", "embeddings", "handler.embeddings.dir (or $EMBEDDINGS_DIR)", "a file stem", suffix=".safetensors"
)
NAME_CHARACTERS = "A-Za-z0-9_.-"


@functools.cache
def _words(names: tuple[str, ...]) -> re.Pattern[str]:
    """Any of ``names`` as a word of a prompt, in any case (the CLIP tokenizers lower-case the text),
    the longest first; a full stop after one ends the sentence, not the name."""
    alternatives = "|".join(re.escape(name) for name in sorted(names, key=len, reverse=True))
    end = rf"(?![{NAME_CHARACTERS.replace('.', '')}]|\.[{NAME_CHARACTERS}])"
    return re.compile(rf"(?<![{NAME_CHARACTERS}])(?:{alternatives}){end}", re.IGNORECASE)


def rewrite(text: str, tokens: Mapping[str, str]) -> str:
    """``text`` with each embedding name it holds replaced by its loaded token, in one pass (so a
    token put in is never read as a name)."""
    if not tokens:
        return text
    by_name = {name.lower(): token for name, token in tokens.items()}
    return _words(tuple(tokens)).sub(lambda match: by_name[match[0].lower()], text)


class EmbeddingLibrary(Library):
    """The embeddings of one directory on one pipeline's tokenizers and text encoders."""

    kind = EMBEDDINGS

    def __init__(self, pipeline: Any, directory: Path | None, max_loaded: int, off_because: str | None = None):
        super().__init__(directory, max_loaded, off_because)
        self.pipeline = pipeline
        # Tokens no prompt says by chance (a prompt typing one would get what it holds): random per worker.
        prefix = secrets.token_hex(3)
        self._ids = (f"<embedding{prefix}x{index}>" for index in itertools.count())
        self._refused: set[str] = set()  # colliding names, logged once

    def encoders(self) -> list[tuple[Any, Any]]:
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

    def named_in(self, *texts: str | None) -> list[list[str]]:
        """For each of ``texts``, the names of the served embeddings it says, as words (the
        directory listed once, one pattern for all its names)."""
        names = {entry.name.lower(): entry.name for entry in self.available()}
        if not names or not any(texts):
            return [[] for _ in texts]
        words = _words(tuple(names.values()))
        return [list(dict.fromkeys(names[match[0].lower()] for match in words.finditer(text or ""))) for text in texts]

    def acquire(self, names: Sequence[str], in_use: Iterable[str]) -> dict[str, str]:
        """Each name's token, loading the embeddings not in memory (or changed since), then evicting
        least recently used ones that ``in_use`` does not hold."""
        return dict(zip(names, self._acquire(names, in_use), strict=True))

    def _load(self, entry: Entry, keep: set[str]) -> str:
        token = next(self._ids)
        try:
            self._check(read_header(entry.path))
            state = load_file(entry.path)
            for (tokenizer, encoder), name in zip(self.encoders(), self._names(state), strict=True):
                self.pipeline.load_textual_inversion(
                    state[name], token=token, tokenizer=tokenizer, text_encoder=encoder
                )
        except Exception as error:  # header, format and width errors alike
            self._forget(token)
            raise self.unloadable(entry, error) from None
        logger.info("embedding %s loaded as %s (%d bytes)", entry.name, token, entry.version[1])
        return token

    def _names(self, names: Iterable[str]) -> list[str]:
        """The file's tensor for each text encoder: SDXL's ``clip_l`` and ``clip_g``, else its one tensor."""
        held = sorted(names)
        if len(self.encoders()) == 2:
            if not {"clip_l", "clip_g"} <= set(held):
                raise ValueError(f"an SDXL embedding holds clip_l and clip_g; this file holds {held[:4]}")
            return ["clip_l", "clip_g"]
        if len(held) != 1:
            raise ValueError(f"an embedding holds one tensor (emb_params, or its token's); this file holds {len(held)}")
        return held

    def _check(self, header: Header) -> None:
        """Refuse, from the header alone, a file whose vectors do not fit the text encoders: a row or
        rows of the encoder's width, fewer than a prompt holds."""
        for name, (tokenizer, encoder) in zip(self._names(header.shapes), self.encoders(), strict=True):
            shape, width = header.shapes[name], encoder.get_input_embeddings().embedding_dim
            rows = shape[0] if len(shape) == 2 else 1
            if len(shape) not in (1, 2) or shape[-1] != width or not 0 < rows < tokenizer.model_max_length - 1:
                raise ValueError(f"{name} has shape {shape}; this model takes up to 75 vectors of width {width}")

    def _forget(self, token: str) -> None:
        """The token and its extra vectors' tokens (``token_1``...) out of every tokenizer and text encoder."""
        own = re.compile(re.escape(token) + r"(_\d+)?")
        for tokenizer, encoder in self.encoders():
            added = [added for added in tokenizer.get_added_vocab() if own.fullmatch(added)]
            if added:
                self.pipeline.unload_textual_inversion(tokens=added, tokenizer=tokenizer, text_encoder=encoder)
