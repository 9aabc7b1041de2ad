"""DeepCache per row for the UNet families: each job keeps its own cached features and step count,
so cached and uncached rows, and rows at different intervals, share the step engine's forwards.

DeepCache (Ma et al., 2023; the ``DeepCache`` package's ``DeepCacheSDHelper``) runs the whole UNet
every ``interval`` steps and caches the outputs of its blocks; at the steps between, the deep blocks
return their cached outputs and only the shallow branch (``branch``: which skip connection it
keeps) computes. The helper decides for the whole batch, from one step counter. Here each job
decides for its own rows, inside the step's one forward:

- rows at a full step (and rows without a cache) run every block, and each cached job keeps the
  outputs its cached steps will read (``record``);
- a module that skips for the rows at a cached step runs on the other rows only, as a sub-batch
  (with their LoRA sets), and returns for the cached rows their kept output: the deep blocks run
  only on the rows at a full step, the shallow branch on every row.

On a compiled denoiser (``regions``), a forward with a cached job (at any of its steps: a full step
keeps outputs) runs the UNet's own forward eagerly, and its attention layers and mid block as
graphs of their own (``_is_region``); a forward without one runs the whole-model graph as ever.

Which block skips at a cached step, and how blocks are numbered, is the helper's
(``DeepCacheSDHelper.is_skip_step`` and ``wrap_modules``, ``DeepCache`` 0.1.1), so a job alone
equals the helper's images in its ``uniform`` mode. Where the helper counts steps by looking the
timestep up in the schedule (its first index: PNDM's schedule repeats one), a job counts its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from handler.families.base import RegionCompiler, RowBlocks, SubBatchRows, eager_call

# A wrapped module: (block type "down", "mid" or "up", its kind, block number, layer number), as the helper keys it.
Key = tuple[str, str, int, int]
LAYER_KINDS = ("attentions", "resnet", "downsampler", "upsampler")


@dataclass(frozen=True)
class Branch:
    """A DeepCache branch: the skip connection kept at cached steps (``branch`` = 3 x block + layer)."""

    block: int
    layer: int

    @classmethod
    def of(cls, branch: int) -> Branch:
        return cls(branch // 3, branch % 3)

    @property
    def number(self) -> int:
        return 3 * self.block + self.layer

    def skips(self, key: Key) -> bool:
        """Whether the module ``key`` returns its cached output at a cached step
        (``DeepCacheSDHelper.is_skip_step`` without its step test)."""
        block_type, _, block, layer = key
        if block > self.block or block_type == "mid":
            return True
        if block < self.block:
            return False
        return layer >= self.layer if block_type == "down" else layer > self.layer

    def keeps(self, key: Key) -> bool:
        """Whether a cached step calls ``key`` and takes its kept output: it skips, and its block
        does not (an inner layer of a skipped block is never called at a cached step)."""
        block_type, kind, block, _ = key
        return self.skips(key) and not (kind in LAYER_KINDS and self.skips((block_type, "block", block, 0)))

    def reused(self, unet: Any) -> Key:
        """The one kept output a cached step's running modules read: the hidden state entering the
        first running layer of up block ``block`` (the output of its last skipped layer, else of
        the up block before it, else of the mid block). Every other kept output flows only into
        modules that skip (the skip connections a running up layer reads come from down layers
        that run: up layer ``k + 1`` of a block reads down layer ``k``), so only its shape matters."""
        up_blocks = unet.up_blocks
        block = up_blocks[len(up_blocks) - 1 - self.block]
        if self.layer + 1 < len(block.resnets):
            kind = "attentions" if getattr(block, "attentions", None) else "resnet"
            return ("up", kind, self.block, self.layer + 1)
        if self.block + 1 < len(up_blocks):
            return ("up", "block", self.block + 1, 0)
        return ("mid", "mid_block", 0, 0)


@dataclass(frozen=True)
class Shape:
    """What stands for a kept output no running module reads: its shape per row and its dtype
    (replayed as zeros expanded over the rows, which take no memory)."""

    row: torch.Size
    dtype: torch.dtype
    device: torch.device

    def over(self, rows: int) -> torch.Tensor:
        return torch.zeros((), dtype=self.dtype, device=self.device).expand(rows, *self.row)


@dataclass
class RowCache:
    """One job's DeepCache: its interval and branch, and from its last full step the output its
    cached steps read (its rows' own copy) and the shapes of the others."""

    interval: int
    branch: Branch
    outputs: dict[Key, Any] = field(default_factory=dict)
    cached_steps: int = 0  # steps that ran the shallow branch only

    def full_step(self, step: int) -> bool:
        """Whether the job's ``step`` (counted from its first) runs every block."""
        return step % self.interval == 0

    def release(self) -> None:
        """Drop what it keeps (the job is done denoising; its count stays)."""
        self.outputs.clear()


@dataclass(frozen=True)
class CacheRows:
    """One job's rows in a forward: its cache (None: none) and row count, and whether this step is
    one of its cached steps."""

    cache: RowCache | None
    rows: int
    cached_step: bool = False

    def replays(self, key: Key) -> bool:
        """Whether its rows take their kept output of ``key`` instead of running it."""
        return self.cached_step and self.cache is not None and self.cache.branch.skips(key)


@dataclass
class _Pass:
    """One forward's rows (the jobs'), and the rows of the module call in progress (indices into
    ``groups``)."""

    groups: list[CacheRows]
    sub_batch_rows: SubBatchRows
    present: list[int]


class DeepCacheHooks:
    """The helper's module wrappers on a UNet, acting per row inside ``forward``; outside it
    (and for jobs without a cache) every module runs as it is. ``regions``: the UNet is compiled,
    and inside ``forward`` its attention layers and mid block run compiled apart."""

    def __init__(self, unet: torch.nn.Module, regions: RegionCompiler | None = None):
        self._unet = unet
        self.compiled = regions is not None  # its blocks run compiled apart in a cached forward
        self._pass: _Pass | None = None
        self._reused = {Branch.of(branch): Branch.of(branch).reused(unet) for branch in range(branches(unet))}
        for key, module in _modules(unet):
            region = regions(module.forward) if regions is not None and _is_region(key) else module.forward
            module.forward = self._wrapped(key, module.forward, region)

    @contextlib.contextmanager
    def forward(self, jobs: Sequence[CacheRows], sub_batch_rows: SubBatchRows) -> Iterator[None]:
        """Within it, the UNet's forward over these rows records what the cached jobs at a full
        step keep and replays it for those at a cached step; ``sub_batch_rows`` gives a sub-batch of
        the jobs (by index) its LoRA rows. The UNet runs its own forward (not its whole-model graph)."""
        groups = list(jobs)
        self._pass = _Pass(groups, sub_batch_rows, list(range(len(groups))))
        try:
            with eager_call(self._unet):
                yield
            for group in groups:  # the forward went through: its cached jobs took a cached step
                if group.cached_step and group.cache is not None:
                    group.cache.cached_steps += 1
        finally:
            self._pass = None

    def _wrapped(self, key: Key, forward: Callable[..., Any], region: Callable[..., Any]) -> Callable[..., Any]:
        """``forward`` outside a cached forward; inside, ``region`` (it compiled, or itself) over the rows that run."""

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            current = self._pass
            if current is None:
                return forward(*args, **kwargs)
            present = current.present
            running = [index for index in present if not current.groups[index].replays(key)]
            if len(running) == len(present):
                output = region(*args, **kwargs)
                self._keep(key, output, current)
                return output
            ran = None
            if running:
                taken = _Taken(RowBlocks([current.groups[index].rows for index in present]), present, running)
                current.present = running
                try:
                    with current.sub_batch_rows(running):
                        ran = region(*taken(args), **taken(kwargs))
                finally:
                    current.present = present
                self._keep(key, ran, current, running)
            return self._joined(key, current, present, running, ran)

        return wrapped

    def _keep(self, key: Key, output: Any, current: _Pass, indices: list[int] | None = None) -> None:
        """What the cached jobs at a full step among the module's rows keep of its output."""
        offset = 0
        for index in current.present if indices is None else indices:
            group = current.groups[index]
            cache = group.cache
            if cache is not None and not group.cached_step and cache.branch.keeps(key):
                reused = key == self._reused[cache.branch]
                cache.outputs[key] = _rows(output, offset, group.rows) if reused else _shape(output)
            offset += group.rows

    def _joined(self, key: Key, current: _Pass, present: list[int], running: list[int], ran: Any) -> Any:
        """The module's output over its rows: the running rows' from ``ran``, the others' kept (the
        hidden state their running modules read) or zeros of its shape (what only skipped modules read)."""
        parts, offset = [], 0
        for index in present:
            group = current.groups[index]
            if index in running:
                parts.append(_rows(ran, offset, group.rows, copy=False))
                offset += group.rows
            else:
                assert group.cache is not None
                kept = group.cache.outputs[key]
                parts.append(kept if key == self._reused[group.cache.branch] else _over(kept, group.rows))
        return _concat(parts)


class _Taken:
    """The rows of a module call's running jobs, taken from its arguments (tensors, and tuples, lists
    and dicts of them, with one row per present row; others as they are)."""

    def __init__(self, blocks: RowBlocks, present: list[int], running: list[int]):
        self.blocks = blocks
        self.running = [present.index(index) for index in running]

    def __call__(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == self.blocks.rows:
            return self.blocks.taken(value, self.running)
        if isinstance(value, tuple | list):
            return type(value)(self(part) for part in value)
        if isinstance(value, dict):
            return {name: self(part) for name, part in value.items()}
        return value


def _modules(unet: Any) -> Iterator[tuple[Key, torch.nn.Module]]:
    """The modules the helper wraps, with its keys (``DeepCacheSDHelper.wrap_modules``)."""
    for block_i, block in enumerate(unet.down_blocks):
        for layer_i, attention in enumerate(getattr(block, "attentions", None) or []):
            yield ("down", "attentions", block_i, layer_i), attention
        resnets = getattr(block, "resnets", None) or []
        for layer_i, resnet in enumerate(resnets):
            yield ("down", "resnet", block_i, layer_i), resnet
        for downsampler in getattr(block, "downsamplers", None) or []:
            yield ("down", "downsampler", block_i, len(resnets)), downsampler
        yield ("down", "block", block_i, 0), block
    yield ("mid", "mid_block", 0, 0), unet.mid_block
    blocks = len(unet.up_blocks)
    for index, block in enumerate(unet.up_blocks):
        block_i = blocks - index - 1
        layers = len(getattr(block, "resnets", None) or [])
        for layer_i, attention in enumerate(getattr(block, "attentions", None) or []):
            yield ("up", "attentions", block_i, layers - layer_i - 1), attention
        for layer_i, resnet in enumerate(getattr(block, "resnets", None) or []):
            yield ("up", "resnet", block_i, layers - layer_i - 1), resnet
        for upsampler in getattr(block, "upsamplers", None) or []:
            yield ("up", "upsampler", block_i, 0), upsampler
        yield ("up", "block", block_i, 0), block


def _is_region(key: Key) -> bool:
    """Whether a wrapped module runs compiled apart on a compiled UNet: an attention layer (a
    ``Transformer2DModel``, diffusers' repeated blocks with the projections around them) or the mid
    block. The resnets and samplers run eagerly: they share a code per kind but differ in their
    weights' shapes (static in dynamo), a graph per pair of widths, some twenty in SD 1.5's UNet."""
    block_type, kind, _, _ = key
    return kind == "attentions" or block_type == "mid"


def _rows(output: Any, start: int, rows: int, copy: bool = True) -> Any:
    """Rows ``start`` to ``start + rows`` of a module's output (a tensor or nested tuples), copied
    (``copy`` False: views)."""
    if isinstance(output, torch.Tensor):
        taken = output[start : start + rows]
        return taken.clone() if copy else taken
    if isinstance(output, tuple):
        return tuple(_rows(part, start, rows, copy) for part in output)
    raise TypeError(f"a DeepCache module returned {type(output).__name__}; tensors and tuples are kept")


def _shape(output: Any) -> Any:
    """The shapes of a module's output (a tensor or nested tuples)."""
    if isinstance(output, torch.Tensor):
        return Shape(output.shape[1:], output.dtype, output.device)
    if isinstance(output, tuple):
        return tuple(_shape(part) for part in output)
    raise TypeError(f"a DeepCache module returned {type(output).__name__}; tensors and tuples are kept")


def _over(shape: Any, rows: int) -> Any:
    """Zeros of a kept output's shapes over ``rows`` rows, taking no memory."""
    return shape.over(rows) if isinstance(shape, Shape) else tuple(_over(part, rows) for part in shape)


def _concat(outputs: Sequence[Any]) -> Any:
    """Outputs of consecutive rows as one output over them (one: itself)."""
    first = outputs[0]
    if len(outputs) == 1:
        return first
    if isinstance(first, torch.Tensor):
        return torch.cat(list(outputs))
    return tuple(_concat(parts) for parts in zip(*outputs, strict=True))


def shallow_share(unet: torch.nn.Module, flops: dict[str, float], branch: Branch) -> float:
    """The share of a full forward's operations a cached step of ``branch`` runs: all but those of
    the outermost modules that skip (``flops``: per module, as ``FlopCounterMode`` names them, the
    root by its class)."""
    root = type(unet).__name__
    names = {id(module): f"{root}.{name}" for name, module in unet.named_modules() if name}
    skipped = sum(flops.get(names[id(module)], 0.0) for key, module in _modules(unet) if branch.keeps(key))
    return max(0.0, 1.0 - skipped / flops[root]) if flops.get(root) else 1.0


def kept_row_shape(unet: Any, branch: Branch, latent: tuple[int, int, int]) -> tuple[int, int, int]:
    """The shape per row of the one output a job at ``branch`` keeps (``Branch.reused``), for
    latents of ``latent`` (channels, height, width): up block ``b`` from the end works at the
    latents' size over 2^b, rounded up as the downsamplers round, with down block ``b``'s channels;
    the mid block at the smallest size with the last down block's."""
    channels = unet.config.block_out_channels
    _, height, width = latent
    block_type, kind, block, _ = branch.reused(unet)
    if block_type == "mid":
        block, out_channels = len(channels) - 1, channels[-1]
    elif kind == "block":  # the output of the up block before: upsampled to block - 1's size
        block, out_channels = block - 1, channels[block]
    else:
        out_channels = channels[block]
    return out_channels, -(-height // 2**block), -(-width // 2**block)


def branches(unet: Any) -> int:
    """How many branches a UNet offers: three per down block."""
    return 3 * len(unet.down_blocks)


def is_unet(denoiser: Any) -> bool:
    """Whether a denoiser has the UNet blocks DeepCache wraps (SD 3's transformer has none)."""
    return all(hasattr(denoiser, name) for name in ("down_blocks", "mid_block", "up_blocks"))
