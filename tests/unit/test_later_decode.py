"""A decode's images are made once, by the first thread that asks, and every asker gets them, or
the error that making them raised; on a GPU, the two-part decode makes the images the pipeline's
end makes on the device."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from PIL import Image

from handler.engine.decoding import DecodeFailed, LaterDecode
from handler.engine.timing import Span
from handler.families import Decoded
from tests.harness.engine_runs import spec, tiny_engine


def test_images_are_made_once_whoever_asks_first():
    made, release = [], threading.Event()

    def postprocess(pixels: torch.Tensor) -> Decoded:
        release.wait(timeout=10)
        made.append(threading.current_thread().name)
        return Decoded([Image.new("L", (1, 1), int(value)) for value in pixels], None)

    decode = LaterDecode.queued(torch.tensor([3.0, 4.0]), Span(torch.device("cpu")).end(), postprocess)
    assert not decode.resolved and decode.seconds is None
    with ThreadPoolExecutor(4) as threads:
        asked = [threads.submit(decode.result) for _ in range(4)]
        release.set()
        results = [future.result() for future in asked]
    assert len(made) == 1 and decode.resolved and decode.seconds is not None and decode.seconds >= 0
    assert all(result is results[0] for result in results)
    assert [image.getpixel((0, 0)) for image in results[0][0].rows(slice(1, 2)).images] == [4]


def test_an_error_making_the_images_reaches_every_asker():
    calls = []

    def postprocess(pixels: torch.Tensor) -> Decoded:
        calls.append(1)
        raise RuntimeError("safety checker broke")

    decode = LaterDecode.queued(torch.zeros(1), Span(torch.device("cpu")).end(), postprocess)
    for _ in range(2):
        with pytest.raises(DecodeFailed, match="RuntimeError: safety checker broke") as failed:
            decode.result()
        assert isinstance(failed.value.error, RuntimeError)
    assert calls == [1] and decode.resolved and decode.seconds is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_two_part_decode_makes_the_images_and_flags_the_device_makes():
    """The pixels' host copy, then the safety checker on an encoder thread's own stream and PIL
    images: level for level and flag for flag what the pipeline's end makes on the device."""
    engine = tiny_engine("sd1-safety", device="cuda")
    (job,) = engine.start([spec(side=64, steps=2, images=2)])
    while not job.done:
        engine.step([job])
    with torch.inference_mode():
        expected = engine.family.postprocess(engine.family.vae_decode(job.latents, False))
    decode = engine.decode_later(job.latents, 64, 64)
    with ThreadPoolExecutor(1, thread_name_prefix="sd-encode") as thread:
        decoded, seconds = thread.submit(decode.result).result()
    assert seconds > 0 and decoded.nsfw_content_detected == expected.nsfw_content_detected
    for ours, theirs in zip(decoded.images, expected.images, strict=True):
        assert np.array_equal(np.asarray(ours), np.asarray(theirs))
