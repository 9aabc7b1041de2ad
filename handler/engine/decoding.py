"""A decode in two parts, so that finished requests stay off the step's path: the VAE decode and
the copy of its pixels to the host are queued on the device (``StepEngine.decode_later``), and the
rest of the pipeline's end (the safety checker or the watermark, PIL images) runs once, on the
thread that first asks for the images or calls ``make`` (the service: an encoder thread on a GPU,
the stepping thread on the CPU). On a GPU that thread waits for the copy, never the thread that
steps; the safety checker's CLIP runs on that thread's own CUDA stream, so its reads wait for its
own work, not for the forwards queued since."""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from handler.engine.timing import Span
from handler.families import Decoded


class DecodeFailed(Exception):
    """Making a decode's images failed (``error``, shared by every request of the decode)."""

    def __init__(self, error: Exception):
        super().__init__(f"{type(error).__name__}: {error}")
        self.error = error


class LaterDecode:
    """A decode's images, made by ``make`` when first asked for (on any thread, once)."""

    def __init__(self, make: Callable[[], tuple[Decoded, float]]):
        self._make: Callable[[], tuple[Decoded, float]] | None = make
        self._lock = threading.Lock()
        self._outcome: tuple[Decoded, float] | Exception | None = None

    @classmethod
    def queued(cls, pixels: torch.Tensor, span: Span, postprocess: Callable[[torch.Tensor], Decoded]) -> LaterDecode:
        """Pixels on their way to the host (there once ``span`` has ended on the device) that the
        family's ``postprocess`` makes images."""
        return cls(functools.partial(_on_host, pixels, span, postprocess))

    @classmethod
    def made(cls, decoded: Decoded, seconds: float) -> LaterDecode:
        """Images made already, in ``seconds``."""
        return cls(lambda: (decoded, seconds))

    @property
    def resolved(self) -> bool:
        """Whether the images were made, or failed to be."""
        return self._outcome is not None

    @property
    def seconds(self) -> float | None:
        """The seconds it took to make the images, once made; None before, or where that failed."""
        return self._outcome[1] if isinstance(self._outcome, tuple) else None

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

    def result(self) -> tuple[Decoded, float]:
        """The images and the seconds it took to make them; the first caller makes them, later
        ones reuse them. ``DecodeFailed`` (a new one for each caller) where that failed."""
        self.make()
        if isinstance(self._outcome, Exception):
            raise DecodeFailed(self._outcome) from self._outcome
        assert self._outcome is not None
        return self._outcome


def _on_host(pixels: torch.Tensor, span: Span, postprocess: Callable[[torch.Tensor], Decoded]) -> tuple[Decoded, float]:
    """Wait for the pixels' copy, then run the family's ``postprocess`` on them: the images and
    the seconds of the device's decode and copy plus the postprocess."""
    device_seconds = span.seconds()
    started = time.perf_counter()
    with torch.inference_mode(), _own_stream(span.device):  # the thread's own mode and stream
        decoded = postprocess(pixels)
    return decoded, device_seconds + time.perf_counter() - started


_streams = threading.local()


def _own_stream(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """This thread's own CUDA stream on ``device`` (made on first use); no stream elsewhere."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    if not hasattr(_streams, "stream"):
        _streams.stream = torch.cuda.Stream(device)
    return torch.cuda.stream(_streams.stream)
