"""First-block caching per row for SD 3.x: each job compares its rows' first-block residual with its
own from its last full step, and skips the other transformer blocks where it barely changed.

First Block Cache (ParaAttention; diffusers' ``apply_first_block_cache``, its ``FBCHeadBlockHook``
and ``FBCBlockHook``, 0.42.1) runs the first transformer block at every step. Where the mean
absolute change of that block's residual (its output's hidden states less its input's), relative
to the mean absolute residual kept from the last full step, is at most ``threshold``, it returns the
first block's output plus the residual of the other blocks kept from that step; otherwise every
block runs, and both residuals are kept. diffusers decides for the whole batch (one ``.item()``);
here each job decides for its own rows, inside the step's one forward:

- every row runs the first block;
- the rows of the jobs that compute (no cache, nothing kept yet, or a change above their
  threshold) run the other blocks as a sub-batch, with their own LoRA sets; each cached one keeps
  its residuals;
- the rows of the others take the first block's output plus their kept residual.

The decision is the one value a step with first-block-cached rows reads on the host: their changes,
as one vector (diffusers reads one a forward too); steps without such rows read none. Threshold 0
skips nothing (a change of exactly 0 aside), so it equals no cache.

On a compiled transformer (``regions``), a forward with first-block-cached rows runs the
transformer's own forward eagerly and each block as a graph of its own (the blocks share one code);
a forward without such rows runs the whole-model graph as ever.

diffusers' hook keeps the encoder hidden states' residual of the last block too, which fails on SD 3
(its last block is ``context_pre_only``: it returns no encoder hidden states); the model discards
them after that block, so only the hidden states' residual is kept here.

The same wrappers serve skip-layer guidance (``StableDiffusion3Pipeline``'s ``skip_guidance_layers``)
inside the step's one forward: diffusers runs a second transformer call over the prompt's rows with
``skip_layers``, whose blocks it does not call; here those rows join the forward, and after each
block they skip, they take its inputs back (``SkipRows``). A job's skip-layer rows are a part of
their own: never cached, they run every block they do not skip.

They also add ControlNet residuals (``StableDiffusion3ControlNetPipeline``'s
``block_controlnet_hidden_states``) after each block, as the transformer's forward adds them: a
forward with ControlNet rows runs the transformer's own forward (and, compiled, its blocks' graphs),
so a ControlNet never compiles the whole-model graph. A job with ControlNets has no step cache, so
the rows it adds to are always rows that compute.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from handler.families.base import RegionCompiler, Residuals, RowBlocks, SubBatchRows, eager_call


@dataclass
class FirstBlockCache:
    """One job's first-block cache: its threshold and, from its last full step, its rows' residuals."""

    threshold: float
    head: torch.Tensor | None = None  # the first block's residual: its hidden states out less in
    tail: torch.Tensor | None = None  # the other blocks': the last one's hidden states less the first's
    cached_steps: int = 0  # steps that skipped the other blocks

    def change(self, head: torch.Tensor) -> torch.Tensor:
        """The relative mean absolute change of a first-block residual from the kept one
        (``FBCHeadBlockHook._should_compute_remaining_blocks``)."""
        assert self.head is not None
        return (head - self.head).abs().mean() / self.head.abs().mean()

    def release(self) -> None:
        """Drop what it keeps (the job is done denoising; its count stays)."""
        self.head = self.tail = None


def kept_row_elements(transformer: Any, latent: tuple[int, int, int]) -> int:
    """The elements a job keeps per row: two residuals of the hidden states (its patches' tokens by
    the transformer's width)."""
    config = transformer.config
    _, height, width = latent
    tokens = (height // config.patch_size) * (width // config.patch_size)
    return 2 * tokens * config.num_attention_heads * config.attention_head_dim


@dataclass(frozen=True)
class SkipRows:
    """Which rows of a forward skip which transformer blocks: ``mask`` (rows, blocks) on the device,
    and the blocks some row skips (on the host: blocks no row skips run as they are)."""

    mask: torch.Tensor
    blocks: frozenset[int]

    def taken(self, rows: RowBlocks, parts: Sequence[int]) -> SkipRows:
        """Those of a sub-batch of the forward's parts."""
        return SkipRows(rows.taken(self.mask, parts), self.blocks)

    def after(self, index: int, before: tuple[Any, torch.Tensor], after: tuple[Any, torch.Tensor]) -> Any:
        """Block ``index``'s (encoder hidden states, hidden states) with the rows that skip it given
        its inputs back (``SD3Transformer2DModel.forward``'s ``is_skip``); the last block's encoder
        hidden states stay None (it returns none: nothing reads them)."""
        if index not in self.blocks:
            return after
        skips = self.mask[:, index].view(-1, 1, 1)
        encoder = None if after[0] is None else torch.where(skips, before[0], after[0])
        return encoder, torch.where(skips, before[1], after[1])


@dataclass
class _Pass:
    """One forward's rows: each job's cache (None: none) and row count, and what the cached jobs
    keep once the forward went through."""

    jobs: Sequence[tuple[FirstBlockCache | None, int]]
    sub_batch_rows: SubBatchRows
    skips: SkipRows | None = None
    controls: Residuals | None = None  # the ControlNet residual each block adds, over all rows (None: none)
    done: bool = False  # the first block ran the others: the transformer's own calls pass through
    # (cache, first-block residual, other blocks' residual) of a job that computed; residuals None: it skipped
    kept: list[tuple[FirstBlockCache, torch.Tensor | None, torch.Tensor | None]] = field(default_factory=list)

    def keep(self) -> None:
        """The residuals of the jobs that computed, and the steps of those that skipped."""
        for cache, head, tail in self.kept:
            if head is None:
                cache.cached_steps += 1
            else:
                cache.head, cache.tail = head, tail

    def blocks(self) -> RowBlocks:
        """Each job's rows."""
        return RowBlocks([rows for _, rows in self.jobs])


class FirstBlockHooks:
    """Wrappers on an SD 3 transformer's blocks, acting per row inside ``forward`` (first-block
    caching, skip-layer guidance, ControlNet residuals); outside it every block runs as it is."""

    def __init__(self, transformer: torch.nn.Module, regions: RegionCompiler | None = None):
        blocks = list(transformer.transformer_blocks)  # type: ignore[arg-type]  # a ModuleList
        self._transformer = transformer
        self.compiled = regions is not None  # its blocks run compiled apart in a cached forward
        self._pass: _Pass | None = None
        self._blocks = blocks
        self._others = blocks[1:]
        self.blocks = len(blocks)
        region_of = regions or (lambda forward: forward)
        blocks[0].forward = self._first(blocks[0].forward, region_of(blocks[0].forward))
        for block in self._others:
            block.forward = self._passing(block.forward, region_of(block.forward))

    def skip_mask(self, layers: Sequence[int]) -> torch.Tensor:
        """A (blocks,) host mask of ``layers``: the blocks a row that skips them skips."""
        mask = torch.zeros(self.blocks, dtype=torch.bool)
        mask[list(layers)] = True
        return mask

    @contextlib.contextmanager
    def forward(
        self,
        jobs: Sequence[tuple[FirstBlockCache | None, int]],
        sub_batch_rows: SubBatchRows,
        skips: SkipRows | None = None,
        controls: Residuals | None = None,
    ) -> Iterator[None]:
        """Within it, the transformer's forward over these rows caches per job (its own forward, not
        its whole-model graph), the rows of ``skips`` skip their blocks, and each block's output
        gains its ControlNet residual of ``controls``; ``sub_batch_rows`` gives a sub-batch of the
        jobs (by index) its LoRA rows. The jobs keep their residuals when the forward went through
        (a retried one decides afresh)."""
        self._pass = current = _Pass(jobs, sub_batch_rows, skips, controls)
        try:
            with eager_call(self._transformer):
                yield
            current.keep()
        finally:
            self._pass = None

    def _first(self, forward: Callable[..., Any], region: Callable[..., Any]) -> Callable[..., Any]:
        """The first block: ``forward`` outside a cached forward; inside, ``region`` (it compiled, or
        itself), then the others or the kept residual per job."""

        def first(**kwargs: Any) -> Any:
            current = self._pass
            if current is None:
                return forward(**kwargs)
            encoder, hidden = region(**kwargs)
            if current.skips is not None:
                inputs = (kwargs["encoder_hidden_states"], kwargs["hidden_states"])
                encoder, hidden = current.skips.after(0, inputs, (encoder, hidden))
            hidden = self._controlled(0, hidden, current.controls)
            hidden = self._others_or_kept(current, kwargs, encoder, hidden)
            current.done = True
            return encoder, hidden

        return first

    def _passing(self, forward: Callable[..., Any], region: Callable[..., Any]) -> Callable[..., Any]:
        """A block after the first: ``forward`` outside a cached forward; inside, ``region`` where
        the first block runs it, else its inputs."""

        def passing(**kwargs: Any) -> Any:
            current = self._pass
            if current is None:
                return forward(**kwargs)
            if current.done:  # FBCBlockHook's skip: its inputs unchanged
                return kwargs["encoder_hidden_states"], kwargs["hidden_states"]
            return region(**kwargs)

        return passing

    def _others_or_kept(
        self, current: _Pass, kwargs: dict[str, Any], encoder: torch.Tensor, first: torch.Tensor
    ) -> torch.Tensor:
        """The last block's hidden states: the other blocks' for the jobs that compute, the first
        block's plus the kept residual for the others; and what each cached job keeps."""
        blocks = current.blocks()
        residual = first - kwargs["hidden_states"]
        computes = _decide(current.jobs, residual, blocks.spans)
        if all(computes):
            last = self._others_on(first, encoder, kwargs, current.skips, current.controls)
        else:
            last = self._sub_batch(current, blocks, computes, first, encoder, kwargs)
        for (cache, _), computed, span in zip(current.jobs, computes, blocks.spans, strict=True):
            if cache is not None:
                kept = (residual[span].clone(), last[span] - first[span]) if computed else (None, None)
                current.kept.append((cache, *kept))
        return last

    def _sub_batch(
        self,
        current: _Pass,
        blocks: RowBlocks,
        computes: list[bool],
        first: torch.Tensor,
        encoder: torch.Tensor,
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        """The other blocks over the rows of the jobs that compute (with their LoRA sets); the
        others' rows from the first block's output and their kept residual."""
        running = [index for index, computed in enumerate(computes) if computed]
        ran: Iterator[torch.Tensor] = iter(())
        if running:
            with current.sub_batch_rows(running):
                hidden = self._others_on(
                    blocks.taken(first, running),
                    blocks.taken(encoder, running),
                    {**kwargs, "temb": blocks.taken(kwargs["temb"], running)},
                    None if current.skips is None else current.skips.taken(blocks, running),
                    _taken(current.controls, blocks, running),
                )
            ran = iter(hidden.split([current.jobs[index][1] for index in running]))
        pieces = [
            next(ran) if computed else first[span] + _tail(cache)
            for (cache, _), computed, span in zip(current.jobs, computes, blocks.spans, strict=True)
        ]
        return torch.cat(pieces)

    def _others_on(
        self,
        hidden: torch.Tensor,
        encoder: torch.Tensor,
        kwargs: dict[str, Any],
        skips: SkipRows | None,
        controls: Residuals | None,
    ) -> torch.Tensor:
        """The other blocks over these rows, those of ``skips`` skipping theirs, each block's output
        with its residual of ``controls``: the last one's hidden states."""
        attention = kwargs.get("joint_attention_kwargs")
        for index, block in enumerate(self._others, start=1):
            out = block(
                hidden_states=hidden,
                encoder_hidden_states=encoder,
                temb=kwargs["temb"],
                joint_attention_kwargs=attention,
            )
            encoder, hidden = out if skips is None else skips.after(index, (encoder, hidden), out)
            hidden = self._controlled(index, hidden, controls)
        return hidden

    def _controlled(self, index: int, hidden: torch.Tensor, controls: Residuals | None) -> torch.Tensor:
        """Block ``index``'s hidden states with its ControlNet residual, where the transformer's
        forward adds one (every block but a ``context_pre_only`` one)."""
        if controls is None or self._blocks[index].context_pre_only:
            return hidden
        return hidden + controls[index]


def _taken(controls: Residuals | None, rows: RowBlocks, parts: Sequence[int]) -> Residuals | None:
    """The ControlNet residuals of a sub-batch of a forward's parts (each shared residual taken once)."""
    if controls is None:
        return None
    taken = {id(residual): rows.taken(residual, parts) for residual in controls}
    return [taken[id(residual)] for residual in controls]


def _decide(
    jobs: Sequence[tuple[FirstBlockCache | None, int]], residual: torch.Tensor, spans: list[slice]
) -> list[bool]:
    """Per job, whether its rows run the other blocks: no cache, nothing kept yet, or a change above
    its threshold (read on the host, all jobs' at once)."""
    compared = [index for index, (cache, _) in enumerate(jobs) if cache is not None and cache.head is not None]
    computes = [True] * len(jobs)
    if compared:
        changes = torch.stack([_cache(jobs, index).change(residual[spans[index]]) for index in compared]).tolist()
        for index, change in zip(compared, changes, strict=True):
            computes[index] = change > _cache(jobs, index).threshold
    return computes


def _cache(jobs: Sequence[tuple[FirstBlockCache | None, int]], index: int) -> FirstBlockCache:
    cache = jobs[index][0]
    assert cache is not None
    return cache


def _tail(cache: FirstBlockCache | None) -> torch.Tensor:
    assert cache is not None and cache.tail is not None  # a job skips only with residuals kept
    return cache.tail


def is_transformer(denoiser: Any) -> bool:
    """Whether a denoiser has the transformer blocks first-block caching wraps (two at least)."""
    return len(getattr(denoiser, "transformer_blocks", ())) >= 2
