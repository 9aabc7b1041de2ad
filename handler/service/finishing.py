"""Finishing: the jobs that are done are decoded together, one VAE call per latent shape (out of
memory: image by image, then in tiles), their images made (the safety checker out of memory:
image by image, ``LaterDecode``) and encoded on encoder threads, and answered.

The VAE decode and the copy of its pixels to the host are queued on the device
(``StepEngine.decode_later``; with ``decode_stream: own``, beside the next forward). On a GPU
(``overlap``) an encoder thread waits for the copy, makes the decode's images once (the safety
checker or the watermark, PIL images) and encodes its request's; the service has queued the next
denoiser forward before it calls ``finish``, and an encoding still running is collected at a later
call: the host never waits for a decode, the GPU steps the requests in flight while the finished
ones are made into answers, and no request waits for another's picture. Without ``overlap`` (the
CPU) the images are made on the stepping thread and only encoded on the encoder threads: torch's
CPU work on another thread slowed the stepping thread's (measured: docs/performance.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from concurrent.futures import Executor, Future

import torch

from handler.api.protocol import Response, internal_error
from handler.engine.decoding import DecodeFailed, LaterDecode
from handler.engine.jobs import DenoiseJob
from handler.engine.loading import release_cached_memory
from handler.engine.step_engine import StepEngine
from handler.families import Decoded
from handler.families.base import row_slices
from handler.metrics import DiffusionMetrics
from handler.service.answers import Answers, Encoding
from handler.service.flights import Flights

logger = logging.getLogger(__name__)


class Finishing:
    """Decodes, encodes and answers the finished jobs of ``flights``."""

    def __init__(
        self,
        engine: StepEngine,
        metrics: DiffusionMetrics,
        flights: Flights,
        answers: Answers,
        encoder: Executor,
        overlap: bool,
    ):
        self.engine = engine
        self.metrics = metrics
        self.flights = flights
        self.answers = answers
        self.encoder = encoder
        self.overlap = overlap  # an encoding still running is collected at a later call
        self._encodings: dict[str, tuple[Encoding, Future[Response]]] = {}
        self._decodes: list[tuple[LaterDecode, int]] = []  # (decode, its images) not yet in the metrics

    def finish(self) -> dict[str, Response]:
        """1. Queue the decodes of the newly finished jobs and hand their requests' encodings to
        the encoder threads; 2. answer the requests whose encoding is done; 3. record the decodes
        done. Every encoding is waited for without ``overlap``, and with it where no job is left to
        step (nothing would run meanwhile)."""
        responses = self._decode_finished()
        for gone in self._encodings.keys() - self.flights.keys():  # dropped: the client left, or the batch failed
            self._encodings.pop(gone)[1].cancel()  # where it has not started
        wait = not self.overlap or all(flight.job.done for flight in self.flights.values())
        for rid, (encoding, encoded) in list(self._encodings.items()):
            if wait or encoded.done():
                del self._encodings[rid]
                responses[rid] = self.answers.succeed(rid, encoding, encoded)
        self._record_decodes()
        return responses

    def _decode_finished(self) -> dict[str, Response]:
        """Queue a decode for the finished jobs not decoded yet, one per latent shape, and submit
        their encodings; the failures' answers."""
        by_shape: dict[tuple, list[str]] = {}
        for rid, flight in self.flights.items():
            if flight.job.done and rid not in self._encodings:
                by_shape.setdefault(flight.job.latent_shape, []).append(rid)
        responses = {}
        for rids in by_shape.values():
            for rid, decoded in self._decode(rids).items():
                if isinstance(decoded, Response):
                    responses[rid] = self.answers.fail(rid, decoded)
                    continue
                encoding = self.answers.encoding(rid, *decoded)
                self._encodings[rid] = (encoding, self.encoder.submit(encoding.run))
        return responses

    def _decode(self, rids: list[str]) -> Mapping[str, tuple[LaterDecode, slice] | Response]:
        """One decode for jobs of one shape, and each job's rows of it; out of memory decodes image
        by image, then in tiles (waited for). An error response for a job that could not be decoded."""
        jobs = [self.flights[rid].job for rid in rids]
        try:
            decode = self.engine.decode_later(
                torch.cat([job.latents for job in jobs]), jobs[0].spec.width, jobs[0].spec.height
            )
        except torch.OutOfMemoryError:
            pass  # retried below, outside the except block (its traceback holds the decode's tensors)
        except Exception as error:
            logger.exception("VAE decode for requests %s failed", rids)
            return {rid: internal_error("VAE decode", error) for rid in rids}
        else:
            if not self.overlap:  # made here: torch's CPU work on other threads slows this one's (docs/performance.md)
                decode.make()
            return self._shared(decode, {rid: job.images for rid, job in zip(rids, jobs, strict=True)})
        release_cached_memory()
        self.metrics.out_of_memory_retry("vae_decode")
        logger.warning("out of memory decoding requests %s together; decoding one image at a time", rids)
        started = time.perf_counter()
        decoded: dict[str, tuple[LaterDecode, slice] | Response] = {}
        decoded_alone: dict[str, Decoded] = {}
        for rid, job in zip(rids, jobs, strict=True):
            alone = self._decode_alone(job)
            if isinstance(alone, Decoded):
                decoded_alone[rid] = alone
            else:
                decoded[rid] = alone
        if decoded_alone:
            decode = LaterDecode.ready(Decoded.join(list(decoded_alone.values())), time.perf_counter() - started)
            decoded.update(self._shared(decode, {rid: len(alone.images) for rid, alone in decoded_alone.items()}))
        return decoded

    def _shared(self, decode: LaterDecode, images: dict[str, int]) -> dict[str, tuple[LaterDecode, slice]]:
        """Each request's rows of ``decode``, which holds ``images`` of each in turn (the decode
        kept for the metrics)."""
        self._decodes.append((decode, sum(images.values())))
        return {rid: (decode, rows) for rid, rows in zip(images, row_slices(list(images.values())), strict=True)}

    def _decode_alone(self, job: DenoiseJob) -> Decoded | Response:
        """A job's images decoded one by one (waited for), each in tiles when it does not fit whole;
        a postprocess that fails (out of memory included) fails the job, the VAE not tried again."""
        parts = []
        for latents in job.latents.split(1):
            for tiled in (False, True):
                try:
                    decode = self.engine.decode_later(latents, job.spec.width, job.spec.height, tiled)
                    parts.append(decode.result().decoded)
                    break
                except torch.OutOfMemoryError as error:
                    failure = error.with_traceback(None)  # its frames hold the failed decode's tensors
                except DecodeFailed as failed:
                    logger.error("the postprocess of one image failed", exc_info=failed.error)
                    return internal_error(DecodeFailed.stage, failed.error)
                except Exception as error:
                    logger.exception("VAE decode of one image failed")
                    return internal_error("VAE decode", error)
                release_cached_memory()
                if not tiled:
                    self.metrics.out_of_memory_retry("vae_decode")
                    logger.warning(
                        "out of memory decoding one %dx%d image; decoding it in tiles", job.spec.width, job.spec.height
                    )
            else:
                logger.error(
                    "one %dx%d image does not decode even in tiles: %s", job.spec.width, job.spec.height, failure
                )
                return internal_error("VAE decode", failure)
        return Decoded.join(parts)

    def _record_decodes(self) -> None:
        """Record the decodes whose images were made (and their postprocess's retries after running
        out of memory); forget those that failed (their requests' answers say so) and those whose
        requests were all dropped."""
        awaited = {encoding.decode for encoding, _ in self._encodings.values()}
        left = []
        for decode, images in self._decodes:
            if decode.resolved:
                if decode.made is not None:
                    self.metrics.decoded(images, decode.made.seconds)
                    for _ in range(decode.made.out_of_memory_retries):
                        self.metrics.out_of_memory_retry("postprocess")
            elif decode in awaited:
                left.append((decode, images))
        self._decodes = left
