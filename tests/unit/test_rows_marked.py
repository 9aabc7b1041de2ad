"""Rows marked dynamic (``handler.families.base.mark_rows`` and ``rows_marked``, which the step engine,
the step caches' regions and the compiled VAE decoder use where
``handler.engine.loading.dynamic_rows`` decides): a compiled function whose calls are marked
compiles one graph for every row count from 2, where unmarked it compiles the first count alone and
then every count again (torch's automatic dynamic shapes); one row stays a graph apart. Dynamo alone
decides this, so the functions compile with its ``eager`` backend."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from handler.config import CompileSettings, HandlerSettings
from handler.engine import loading
from handler.engine.loading import _apply_compile, _region_compiler, dynamic_rows
from handler.families.base import mark_rows, rows_marked


def _marked_block(hidden: torch.Tensor, temb: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return hidden @ weight + temb


def _unmarked_block(hidden: torch.Tensor, temb: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return hidden @ weight + temb


def _graphs(function) -> int:
    return len(_debug_get_cache_entry_list(function.__code__))


def _call(block, rows: int) -> torch.Tensor:
    return block(torch.ones(rows, 5), temb=torch.ones(rows, 3), weight=torch.ones(5, 3))


def test_marked_calls_compile_one_graph_for_every_count_from_two_and_one_row_apart():
    torch._dynamo.reset()
    marked = rows_marked(torch.compile(_marked_block, backend="eager"))
    unmarked = torch.compile(_unmarked_block, backend="eager")
    for rows in (4, 2, 3):  # none is the weight's 5
        assert torch.equal(_call(marked, rows), _call(unmarked, rows))
    assert (_graphs(_marked_block), _graphs(_unmarked_block)) == (1, 2)
    _call(marked, 1)
    _call(marked, 7)
    assert _graphs(_marked_block) == 2


def test_only_tensors_led_by_the_rows_are_marked():
    rows, other, scalar, single = torch.ones(3, 5), torch.ones(5, 3), torch.tensor(1.0), torch.ones(1, 5)
    mark_rows(3, [rows, other, scalar, None, 3])
    mark_rows(1, [single])
    marks = [getattr(tensor, "_dynamo_weak_dynamic_indices", set()) for tensor in (rows, other, scalar, single)]
    assert marks == [{0}, set(), set(), set()]


def test_one_decision_marks_the_denoiser_the_regions_and_the_decoder(monkeypatch):
    """``dynamic_rows``: where ``compile.dynamic`` is unset and a forward may step more than one
    image; the regions' compiler marks their rows only then."""
    settings = {"model_path": "/unused"}
    decided = {
        (dynamic, images): dynamic_rows(
            HandlerSettings.model_validate(
                {
                    **settings,
                    "max_images_per_call": images,
                    "limits": {"max_images_per_request": 1},
                    "compile": {"dynamic": dynamic},
                }
            )
        )
        for dynamic in (None, False, True)
        for images in (1, 4)
    }
    assert [key for key, marked in decided.items() if marked] == [(None, 4)]
    monkeypatch.setattr(torch, "compile", lambda function, **_: function)  # the marks alone
    for marked in (True, False):
        hidden = torch.ones(3, 5)
        region = _region_compiler(CompileSettings(enabled=True), marked)
        assert region is not None
        region(_marked_block)(hidden, temb=torch.ones(3, 3), weight=torch.ones(5, 3))
        assert getattr(hidden, "_dynamo_weak_dynamic_indices", set()) == ({0} if marked else set())


def test_what_runs_at_any_row_count_compiles_without_cuda_graphs(monkeypatch):
    """The step cache's regions and the VAE decoder (decodes come in any count) compile in the
    configured mode without CUDA graphs, which cudagraph trees would record per count while serving."""
    modes: list[tuple[str, str]] = []
    monkeypatch.setattr(
        torch, "compile", lambda function, mode, **_: modes.append((function.__name__, mode)) or function
    )
    for mode in ("reduce-overhead", "max-autotune", "default"):
        options = CompileSettings(enabled=True, mode=mode, targets=["unet", "vae_decoder"])
        region = _region_compiler(options, marked=False)
        assert region is not None
        region(_marked_block)
        family = SimpleNamespace(
            denoiser=torch.nn.Linear(1, 1), pipeline=SimpleNamespace(vae=SimpleNamespace(decode=_unmarked_block))
        )
        _apply_compile(family, HandlerSettings.model_validate({"model_path": "/unused", "compile": options}))
    # per mode: a region, the whole denoiser (which keeps the mode asked for), the decoder
    assert modes == [
        ("_marked_block", "default"),
        ("_call_impl", "reduce-overhead"),
        ("_unmarked_block", "default"),
        ("_marked_block", "max-autotune-no-cudagraphs"),
        ("_call_impl", "max-autotune"),
        ("_unmarked_block", "max-autotune-no-cudagraphs"),
        ("_marked_block", "default"),
        ("_call_impl", "default"),
        ("_unmarked_block", "default"),
    ]


def _region(hidden: torch.Tensor) -> torch.Tensor:
    return hidden * 2


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "own_keyword",
    [False, *([True] if loading._COMPILE_TAKES_RECOMPILE_LIMIT else [])],
    ids=lambda own: "keyword" if own else "per-call-limit",
)
def test_a_region_keeps_its_own_recompile_limit(monkeypatch, fresh_dynamo, own_keyword):
    """``compile_with_limit`` keeps graphs past dynamo's default limit of 8 a code, up to its own,
    and leaves the process's limit as it was: with torch.compile's ``recompile_limit``, and where
    torch lacks it (2.11) by raising the limit for each call."""
    monkeypatch.setattr(loading, "_COMPILE_TAKES_RECOMPILE_LIMIT", own_keyword)
    default = torch._dynamo.config.recompile_limit
    region = loading.compile_with_limit(_region, default + 2, backend="eager", dynamic=False)
    for rows in range(1, default + 5):
        assert torch.equal(region(torch.ones(rows)), torch.full((rows,), 2.0))
    assert _graphs(_region) == default + 2
    assert torch._dynamo.config.recompile_limit == default
