"""A decode in two parts, so that finished requests stay off the step's path: the VAE decode and
the copy of its pixels to the host are queued on the device (``StepEngine.decode_later``; with
``decode_stream: own``, on CUDA on a stream of their own beside the step's, ``DecodeStream``), and
the rest of the pipeline's end (the safety checker or the watermark, PIL images) runs once, on the
thread that first asks for the images or calls ``make`` (the service: an encoder thread on a GPU,
the stepping thread on the CPU). On a GPU the thread that steps waits for no copy: an encoder
thread does; the safety checker's CLIP runs on that thread's own CUDA stream, so its reads wait
for its own work, not for the forwards queued since. A safety checker that runs out of memory on a
decode's images runs again image by image (``Made.out_of_memory_retries``)."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from handler.engine.timing import Span
from handler.families import Decoded

logger = logging.getLogger(__name__)


class DecodeStream:
    """Where the engine's VAE decodes run: ``own`` on CUDA, a stream of their own, each decode
    starting once the step's stream has passed the forward that finished its jobs, so the forward
    queued after it on the step's stream runs beside it instead of after it (the caching allocator
    keeps a pool per stream: the decode's working memory is held beside the forward's, and where
    both do not fit it frees its cache and waits for the device); otherwise the current stream."""

    def __init__(self, stream: torch.cuda.Stream | None = None):
        self.stream = stream

    @classmethod
    def on(cls, device: torch.device, setting: str) -> DecodeStream:
        """``decode_stream``'s stream on ``device``: ``own`` on CUDA, else the step's."""
        return cls(torch.cuda.Stream(device) if setting == "own" and device.type == "cuda" else None)

    @property
    def setting(self) -> str:
        """What it is, as ``decode_stream`` names it."""
        return "step" if self.stream is None else "own"

    @contextlib.contextmanager
    def after_the_step(self, latents: torch.Tensor) -> Iterator[None]:
        """The block's work queued on the decode stream, after what the step's stream holds now;
        ``latents`` (made on the step's stream) kept from reuse until the decode stream has read them."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            latents.record_stream(self.stream)  # the step's stream reuses their memory only after the decode


class Made(NamedTuple):
    """A decode's images, the seconds it took to make them, and how often making them ran out of
    memory and was redone image by image."""

    decoded: Decoded
    seconds: float
    out_of_memory_retries: int = 0


class DecodeFailed(Exception):
    """Making a decode's images failed (``error``, shared by every request of the decode)."""

    stage = "postprocess (safety checker or watermark, PIL images)"  # what failed, as answers name it

    def __init__(self, error: Exception):
        super().__init__(f"{type(error).__name__}: {error}")
        self.error = error


class LaterDecode:
    """A decode's images, made by ``make`` when first asked for (on any thread, once)."""

    def __init__(self, make: Callable[[], Made]):
        self._make: Callable[[], Made] | None = make
        self._lock = threading.Lock()
        self._outcome: Made | Exception | None = None

    @classmethod
    def queued(cls, pixels: torch.Tensor, span: Span, postprocess: Callable[[torch.Tensor], Decoded]) -> LaterDecode:
        """Pixels on their way to the host (there once ``span`` has ended on the device) that the
        family's ``postprocess`` makes images."""
        return cls(functools.partial(_on_host, pixels, span, postprocess))

    @classmethod
    def ready(cls, decoded: Decoded, seconds: float) -> LaterDecode:
        """Images made already, in ``seconds``."""
        return cls(lambda: Made(decoded, seconds))

    @property
    def resolved(self) -> bool:
        """Whether the images were made, or failed to be."""
        return self._outcome is not None

    @property
    def made(self) -> Made | None:
        """The images, once made; None before, or where that failed."""
        return self._outcome if isinstance(self._outcome, Made) else None

    def make(self) -> None:
        """Make the images on this thread, where no one has; a failure is kept for ``result``."""
        with self._lock:
            if self._make is not None:
                try:
                    self._outcome = self._make()
                except Exception as error:
                    traceback.clear_frames(error.__traceback__)  # its frames would keep the pixels
                    self._outcome = error
                self._make = None  # and with it the pixels' memory

    def result(self) -> Made:
        """The images and the seconds it took to make them; the first caller makes them, later
        ones reuse them. ``DecodeFailed`` (a new one for each caller) where that failed."""
        self.make()
        if isinstance(self._outcome, Exception):
            raise DecodeFailed(self._outcome) from self._outcome
        assert self._outcome is not None
        return self._outcome


def _on_host(pixels: torch.Tensor, span: Span, postprocess: Callable[[torch.Tensor], Decoded]) -> Made:
    """Wait for the pixels' copy, then run the family's ``postprocess`` on them (out of memory:
    again image by image): the images and the seconds of the device's decode and copy plus the
    postprocess."""
    device_seconds = span.seconds()
    started = time.perf_counter()
    with torch.inference_mode(), _own_stream(span.device):  # the thread's own mode and stream
        try:
            return Made(postprocess(pixels), device_seconds + time.perf_counter() - started)
        except torch.OutOfMemoryError as error:
            if pixels.shape[0] == 1:
                raise
            logger.warning("out of memory making %d images (%s); making them one at a time", pixels.shape[0], error)
        # Retried outside the except block, whose traceback holds the failed attempt's tensors. No
        # empty_cache here: the stepping thread may be capturing a CUDA graph, and the allocator frees
        # its cached blocks itself before it reports out of memory.
        decoded = Decoded.join([postprocess(image) for image in pixels.split(1)])
    return Made(decoded, device_seconds + time.perf_counter() - started, out_of_memory_retries=1)


_streams = threading.local()


def _own_stream(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """This thread's own CUDA stream on ``device`` (made on first use); no stream elsewhere."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    if not hasattr(_streams, "stream"):
        _streams.stream = torch.cuda.Stream(device)
    return torch.cuda.stream(_streams.stream)
