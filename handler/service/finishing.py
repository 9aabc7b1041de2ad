"""Finishing: the jobs that are done are decoded together, one VAE call per latent shape (out of
memory: image by image, then in tiles), their images encoded on encoder threads, and answered.

On a GPU (``overlap``) the service has queued the next denoiser forward before it calls
``finish``, and an encoding still running is collected at a later call: the GPU steps the
requests in flight while the finished ones are encoded, so no request waits for another's picture.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Executor, Future

import torch

from handler.api.protocol import Response, internal_error
from handler.engine.jobs import DenoiseJob
from handler.engine.loading import release_cached_memory
from handler.engine.step_engine import StepEngine
from handler.families import Decoded
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

    def finish(self) -> dict[str, Response]:
        """1. Decode the newly finished jobs and hand their encoding to the encoder threads;
        2. answer the requests whose encoding is done. Every encoding is waited for without
        ``overlap``, and with it where no job is left to step (nothing would run meanwhile)."""
        responses = self._decode_finished()
        for gone in self._encodings.keys() - self.flights.keys():  # dropped: the client left, or the batch failed
            del self._encodings[gone]
        wait = not self.overlap or all(flight.job.done for flight in self.flights.values())
        for rid, (encoding, encoded) in list(self._encodings.items()):
            if wait or encoded.done():
                del self._encodings[rid]
                responses[rid] = self.answers.succeed(rid, encoding, encoded)
        return responses

    def _decode_finished(self) -> dict[str, Response]:
        """Decode the finished jobs not decoded yet, one VAE call per latent shape, and submit their
        encodings; the failures' answers."""
        by_shape: dict[tuple, list[str]] = {}
        for rid, flight in self.flights.items():
            if flight.job.done and rid not in self._encodings:
                by_shape.setdefault(flight.job.latent_shape, []).append(rid)
        responses = {}
        for rids in by_shape.values():
            started = time.perf_counter()
            decoded = self._decode(rids)
            seconds = time.perf_counter() - started
            images = sum(len(result.images) for result in decoded.values() if isinstance(result, Decoded))
            if images:
                self.metrics.decoded(images, seconds)
            for rid, result in decoded.items():
                if isinstance(result, Decoded):
                    encoding = self.answers.encoding(rid, result, seconds)
                    self._encodings[rid] = (encoding, self.encoder.submit(encoding.run))
                else:
                    responses[rid] = self.answers.fail(rid, result)
        return responses

    def _decode(self, rids: list[str]) -> dict[str, Decoded | Response]:
        """One decode for jobs of one shape; out of memory decodes image by image, then in tiles.
        An error response for a job that could not be decoded."""
        jobs = [self.flights[rid].job for rid in rids]
        try:
            decoded = self.engine.decode(
                torch.cat([job.latents for job in jobs]), jobs[0].spec.width, jobs[0].spec.height
            )
            return dict(zip(rids, decoded.split([job.images for job in jobs]), strict=True))
        except torch.OutOfMemoryError:
            pass  # retried below, outside the except block (its traceback holds the decode's tensors)
        except Exception as error:
            logger.exception("VAE decode for requests %s failed", rids)
            return {rid: internal_error("VAE decode", error) for rid in rids}
        release_cached_memory()
        self.metrics.out_of_memory_retry("vae_decode")
        logger.warning("out of memory decoding requests %s together; decoding one image at a time", rids)
        return {rid: self._decode_alone(self.flights[rid].job) for rid in rids}

    def _decode_alone(self, job: DenoiseJob) -> Decoded | Response:
        """A job's images one by one, each in tiles when it does not fit whole."""
        parts = []
        for latents in job.latents.split(1):
            for tiled in (False, True):
                try:
                    parts.append(self.engine.decode(latents, job.spec.width, job.spec.height, tiled=tiled))
                    break
                except torch.OutOfMemoryError as error:
                    failure = error
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
