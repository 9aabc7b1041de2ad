"""A decode's images are made once, by the first thread that asks, and every asker gets them, or
the error that making them raised; on a GPU, the two-part decode makes the images the pipeline's
end makes on the device, and with ``decode_stream: own`` on a stream of its own beside the next
forward."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from PIL import Image

from handler.config import FaultInjection
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
    assert not decode.resolved and decode.made is None
    with ThreadPoolExecutor(4) as threads:
        asked = [threads.submit(decode.result) for _ in range(4)]
        release.set()
        results = [future.result() for future in asked]
    assert len(made) == 1 and decode.resolved and decode.made is not None and decode.made.seconds >= 0
    assert all(result is results[0] for result in results)
    assert [image.getpixel((0, 0)) for image in results[0].decoded.rows(slice(1, 2)).images] == [4]


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
    assert calls == [1] and decode.resolved and decode.made is None


def test_images_that_run_out_of_memory_together_are_made_one_at_a_time():
    """A safety checker out of memory on a decode's images (its CLIP on the device) makes them
    again image by image, the retry counted; an image out of memory alone fails the decode."""
    made = []

    def postprocess(pixels: torch.Tensor) -> Decoded:
        if pixels.shape[0] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory")
        made.append(int(pixels[0]))
        return Decoded([Image.new("L", (1, 1), int(value)) for value in pixels], [int(value) == 4 for value in pixels])

    decode = LaterDecode.queued(torch.tensor([3.0, 4.0, 5.0]), Span(torch.device("cpu")).end(), postprocess)
    decoded, _, retries = decode.result()
    assert made == [3, 4, 5] and retries == 1 and decode.made is not None and decode.made.out_of_memory_retries == 1
    assert [image.getpixel((0, 0)) for image in decoded.images] == [3, 4, 5]
    assert decoded.nsfw_content_detected == [False, True, False]

    def never_fits(pixels: torch.Tensor) -> Decoded:
        made.append(pixels.shape[0])
        raise torch.OutOfMemoryError("CUDA out of memory")

    made.clear()
    alone = LaterDecode.queued(torch.tensor([6.0]), Span(torch.device("cpu")).end(), never_fits)
    with pytest.raises(DecodeFailed, match="OutOfMemoryError"):
        alone.result()
    assert made == [1], "one image that does not fit is not tried again"
    made.clear()
    several = LaterDecode.queued(torch.tensor([6.0, 7.0]), Span(torch.device("cpu")).end(), never_fits)
    with pytest.raises(DecodeFailed, match="OutOfMemoryError") as failed:
        several.result()
    assert made == [2, 1] and failed.value.error.__context__ is None, "the first attempt's error is let go"


def test_a_safety_checker_out_of_memory_makes_the_images_and_flags_of_the_whole_decode():
    """The tiny SD 1 model's safety checker out of memory on two images (fault injection), the
    first the one it flags: made one at a time, level for level and flag for flag what the
    pipeline's end makes at once."""
    engine = tiny_engine("sd1-safety")
    (job,) = engine.start([spec("flag this picture", seed=0, side=64, steps=4, images=2)])  # its calibration
    while not job.done:
        engine.step([job])
    with torch.inference_mode():
        expected = engine.family.postprocess(engine.family.vae_decode(job.latents, False))
    engine.fault_injection = FaultInjection(postprocess_out_of_memory_above_pixels=64 * 64)
    decoded, _, retries = engine.decode_later(job.latents, 64, 64).result()
    assert expected.nsfw_content_detected == [True, False]
    assert retries == 1 and decoded.nsfw_content_detected == expected.nsfw_content_detected
    for ours, theirs in zip(decoded.images, expected.images, strict=True):
        assert np.array_equal(np.asarray(ours), np.asarray(theirs))


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
        decoded, seconds, retries = thread.submit(decode.result).result()
    assert seconds > 0 and retries == 0 and decoded.nsfw_content_detected == expected.nsfw_content_detected
    for ours, theirs in zip(decoded.images, expected.images, strict=True):
        assert np.array_equal(np.asarray(ours), np.asarray(theirs))


SLEEP_CYCLES = 10**9  # about half a second of a GPU's clock: the decode stream held back that long


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_an_own_decode_stream_runs_beside_the_next_forward(monkeypatch):
    """With ``decode_stream: own`` the VAE decode runs on the engine's decode stream: what the
    step's stream queues after it (the next forward) is done while the decode still runs, the
    latents the step let go are not reused under it (a step's tensor of their size, written at
    once, would take their block), and the images are those of a decode on the step's stream."""
    engine = tiny_engine("sd1-safety", device="cuda", decode_stream="own")
    (job,) = engine.start([spec(side=64, steps=2, images=2)])
    while not job.done:
        engine.step([job])
    with torch.inference_mode():
        expected = engine.family.postprocess(engine.family.vae_decode(job.latents, False))
    vae_decode, streams = engine.family.vae_decode, []

    def held_back(latents: torch.Tensor, tiled: bool) -> torch.Tensor:
        streams.append(torch.cuda.current_stream())
        torch.cuda._sleep(SLEEP_CYCLES)
        return vae_decode(latents, tiled)

    monkeypatch.setattr(engine.family, "vae_decode", held_back)
    with torch.inference_mode():
        latents = job.latents.clone()
        torch.cuda.synchronize()
        decode = engine.decode_later(latents, 64, 64)
        del latents  # the step's last reference
        torch.full_like(job.latents, float("nan"))  # the step's next tensor of their size
    next_forward = torch.cuda.Event()
    next_forward.record()
    next_forward.synchronize()
    assert streams == [engine.decode_stream.stream] != [torch.cuda.current_stream()]
    assert not engine.decode_stream.stream.query(), "the step's stream waited for the decode"
    decoded = decode.result().decoded
    assert decoded.nsfw_content_detected == expected.nsfw_content_detected
    for ours, theirs in zip(decoded.images, expected.images, strict=True):
        assert np.array_equal(np.asarray(ours), np.asarray(theirs))


def test_the_decode_stream_is_the_steps_unless_asked_and_on_cuda():
    """``decode_stream`` as shipped (``step``), and ``own`` off CUDA: no stream of its own."""
    shipped, asked = tiny_engine("sd1", device="cpu"), tiny_engine("sd1", device="cpu", decode_stream="own")
    assert shipped.decode_stream.stream is None and "decode_stream=step" in shipped.description
    assert asked.decode_stream.stream is None and "decode_stream=step" in asked.description  # the CPU
