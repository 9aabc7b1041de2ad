"""Textual-inversion embeddings (``handler.adapters.embeddings``): a prompt or negative prompt that
says an embedding's name gets it, as diffusers' ``load_textual_inversion`` gives it, in A1111's,
diffusers' and SDXL's two-encoder files; jobs with and without embeddings start together and share
forwards, each equal to diffusers' call; eviction and changed files; a name that is a word of the
vocabulary, a file of the wrong width or format, and SD 3.x are refused by name."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from bench.reference import Reference
from handler.adapters.embeddings import EmbeddingLibrary, rewrite
from handler.adapters.library import EntryError
from handler.checkpoints.tokenizers import clip_tokenizer
from handler.engine.step_engine import StepEngine
from server.paths import TINY_MODEL_DIRS
from tests.harness.engine_runs import assert_same_images, run, spec, tiny_engine

WIDTH = 32  # the tiny text encoders' hidden size (both of SDXL's)


def vectors(seed: int, rows: int) -> torch.Tensor:
    return torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(seed)) * 0.5


def write_embeddings(directory: Path, family: str) -> Path:
    """A1111's format (two vectors) and diffusers' (one vector), or SDXL's two-encoder files (as many)."""
    directory.mkdir(parents=True, exist_ok=True)
    if family == "sdxl":
        for name, seed, rows in (("tinystyle", 1, 2), ("tinyneg", 2, 1)):
            tensors = {"clip_l": vectors(seed, rows), "clip_g": vectors(seed + 10, rows)}
            save_file(tensors, directory / f"{name}.safetensors")
        return directory
    save_file({"emb_params": vectors(1, 2)}, directory / "tinystyle.safetensors")  # A1111
    save_file({"<tinyneg>": vectors(2, 1)[0]}, directory / "tinyneg.safetensors")  # diffusers
    return directory


def engine_with(family: str, directory: Path, **more) -> StepEngine:
    return tiny_engine(family, embeddings={"dir": str(directory), **more})


def started(engine: StepEngine, prompt: str, negative: str | None, seed: int, keep: set[str] | None = None):
    """The job spec of a request, its embeddings acquired and named as the service does it."""
    library = engine.embeddings
    assert library is not None
    in_prompt, in_negative = library.named_in(prompt, negative)
    names = list(dict.fromkeys(in_prompt + in_negative))
    tokens = library.acquire(names, keep or set())
    if keep is not None:
        keep.update(tokens.values())
    return spec(rewrite(prompt, tokens), seed, steps=4, negative=negative and rewrite(negative, tokens))


REQUESTS = [  # prompt, negative prompt
    ("a tinystyle red circle", None),
    ("a blue square", "tinyneg, blurry"),
    ("a green triangle", None),  # names none
    ("tinystyle in a field", "TINYNEG"),  # any case (one vector: diffusers gives it in any case too)
]


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_embeddings_in_prompts_and_negative_prompts_share_forwards_and_each_equals_diffusers(family, tmp_path):
    directory = write_embeddings(tmp_path / "embeddings", family)
    engine = engine_with(family, directory)
    keep: set[str] = set()
    jobs = [started(engine, prompt, negative, seed, keep) for seed, (prompt, negative) in enumerate(REQUESTS)]
    assert "tinystyle" not in jobs[0].prompt and jobs[2].prompt == "a green triangle"
    # A longer word names none; another case names it, with all its vectors (diffusers gives a
    # multi-vector embedding its first vector only there: its prompt rewrite is case-sensitive).
    assert engine.embeddings.named_in("a tinystylex circle") == [[]]
    assert engine.embeddings.named_in("a TinyStyle circle") == [["tinystyle"]]
    together = run(engine, [(0, job) for job in jobs])  # started together: one text-encoder call
    reference = Reference(TINY_MODEL_DIRS[family])
    files = [directory / "tinystyle.safetensors", directory / "tinyneg.safetensors"]
    for (prompt, negative), job, decoded in zip(REQUESTS, jobs, together, strict=True):
        theirs = reference(
            prompt, job.seeds[0], 64, 64, 4, negative_prompt=negative, scheduler=job.scheduler, embeddings=files
        )
        assert_same_images(decoded, theirs)
    # The embedding acts: without it the image is another.
    plain = reference(REQUESTS[0][0], 0, 64, 64, 4, scheduler=jobs[0].scheduler)
    assert together[0].images[0].tobytes() != plain.images[0].tobytes()


def test_a_name_that_is_a_word_of_the_vocabulary_is_refused_by_name_and_not_listed(tmp_path, caplog):
    directory = write_embeddings(tmp_path / "embeddings", "sd1")
    save_file({"emb_params": vectors(3, 1)}, directory / "x.safetensors")  # a word of the tiny byte-level vocabulary
    library = engine_with("sd1", directory).embeddings
    with caplog.at_level(logging.WARNING, logger="handler.adapters.embeddings"):
        listed = {entry.name for entry in library.available()}
    assert listed == {"tinystyle", "tinyneg"}
    assert "embedding x refused: 'x' is a word of the model's vocabulary" in caplog.text
    assert library.named_in("an x circle") == [[]]
    # With CLIP's own vocabulary, as a real model has it: cat is a word, easynegative is not.
    save_file({"emb_params": vectors(3, 1)}, directory / "cat.safetensors")
    save_file({"emb_params": vectors(4, 1)}, directory / "easynegative.safetensors")
    clip = SimpleNamespace(tokenizer=clip_tokenizer(), text_encoder=None)
    listed = {entry.name for entry in EmbeddingLibrary(clip, directory, 4).available()}
    assert "easynegative" in listed and "cat" not in listed


def test_eviction_and_a_changed_file_load_anew_and_each_image_follows_the_file(tmp_path):
    directory = write_embeddings(tmp_path / "embeddings", "sd1")
    engine = engine_with("sd1", directory, max_loaded=1)
    first = started(engine, "a tinystyle circle", None, 1)
    started(engine, "a tinyneg circle", None, 2)  # evicts tinystyle: one in memory
    assert engine.embeddings.loaded == 1
    again = started(engine, "a tinystyle circle", None, 1)
    (before,) = run(engine, [(0, again)])
    save_file({"emb_params": vectors(9, 2)}, directory / "tinystyle.safetensors")  # changed while serving
    changed = started(engine, "a tinystyle circle", None, 1)
    assert changed.prompt != first.prompt  # a new token for the new version
    (after,) = run(engine, [(0, changed)])
    reference = Reference(TINY_MODEL_DIRS["sd1"])
    files = [directory / "tinystyle.safetensors"]
    expected = reference("a tinystyle circle", 1, 64, 64, 4, scheduler="ddim", embeddings=files)
    assert_same_images(after, expected)
    assert before.images[0].tobytes() != after.images[0].tobytes()


@pytest.mark.parametrize(
    ("tensors", "says"),
    [
        (
            {"emb_params": torch.zeros(1, 48)},
            "emb_params has shape \\(1, 48\\); this model takes up to 75 vectors of width 32",
        ),
        ({"emb_params": torch.zeros(80, WIDTH)}, "emb_params has shape \\(80, 32\\)"),
        ({"a": torch.zeros(1, WIDTH), "b": torch.zeros(1, WIDTH)}, "holds one tensor"),
    ],
)
def test_a_file_that_does_not_fit_is_refused_naming_it_and_leaves_nothing_behind(tmp_path, tensors, says):
    directory = write_embeddings(tmp_path / "embeddings", "sd1")
    save_file(tensors, directory / "odd.safetensors")
    engine = engine_with("sd1", directory)
    tokens_before = len(engine.pipeline.tokenizer)
    with pytest.raises(EntryError, match=says) as refused:
        started(engine, "an odd circle", None, 1)
    assert refused.value.rule == "embedding_unloadable"
    assert len(engine.pipeline.tokenizer) == tokens_before
    assert started(engine, "a tinystyle circle", None, 1).prompt.startswith("a <embedding")


def test_sd3_serves_no_embeddings_and_says_why(tmp_path):
    engine = engine_with("sd3", write_embeddings(tmp_path / "embeddings", "sd1"))
    assert engine.embeddings.available() == [] and engine.embeddings.named_in("a tinystyle circle") == [[]]
    assert "takes no textual-inversion embeddings" in (engine.embeddings.off_because or "")


def test_names_are_replaced_in_one_pass_longest_first_and_a_full_stop_ends_them():
    tokens = {"neg": "<t1>", "neg-v2": "<t2>", "style": "<t3>"}
    assert rewrite("style, neg-v2 and NEG.", tokens) == "<t3>, <t2> and <t1>."
    assert rewrite("neg.v2 negative style_x", tokens) == "neg.v2 negative style_x"  # longer names, other words
    assert rewrite("a neg", {}) == "a neg"
