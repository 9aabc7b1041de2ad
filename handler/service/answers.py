"""What every request gets: parts of its answer, then exactly one final one; the latency of the
requests answered is recorded once their answers leave the worker."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

from handler.api.protocol import Api, Response, internal_error
from handler.api.request import GenerationRequest
from handler.engine.decoding import DecodeFailed, LaterDecode
from handler.metrics import DiffusionMetrics
from handler.service.flights import Flight, Flights

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Encoding:
    """A request's answer to make (``run``: its images from ``decode``, then encoded) and the
    metadata it reports (``run`` fills in the flags and the decode's and the encoding's seconds)."""

    run: Callable[[], Response]
    metadata: dict[str, Any]
    decode: LaterDecode


class Answers:
    """Answers the requests in ``flights``: a success or a failure ends a request's flight."""

    def __init__(self, flights: Flights, metrics: DiffusionMetrics, clock: Callable[[], float]):
        self.flights = flights
        self.metrics = metrics
        self.clock = clock
        # (arrived, encode seconds; None for a failure) of the requests answered since the last delivery
        self._answered: list[tuple[float, float | None]] = []

    def encoding(self, rid: str, decode: LaterDecode, rows: slice) -> Encoding:
        """The encoding of a request's images (``rows`` of ``decode``) in its API's answer, with the
        metadata it reports: an encoder thread runs ``Encoding.run``, which touches nothing the
        service shares but the decode (the first of its requests to run makes its images)."""
        flight = self.flights[rid]
        metadata: dict[str, Any] = {
            "seed": flight.request.seed,
            "parameters": flight.request.parameters(),
            "nsfw_content_detected": None,
            "batch": {"requests": flight.admitted_with, "max_step_images": flight.max_step_images},
            "timings": {
                "admission_s": round(flight.admitted - flight.arrived, 6),
                "denoise_s": round(flight.denoised - flight.admitted, 6),
                "vae_decode_s": None,
            },
        }
        run = functools.partial(_answer, flight.api, flight.request, decode, rows, metadata)
        return Encoding(run, metadata, decode)

    def succeed(self, rid: str, encoding: Encoding, encoded: Future[Response]) -> Response:
        """A request's answer from its finished encoding: where its images could not be made, a
        500 (507 out of memory) naming the postprocess; where the encoding failed, a 500 naming it."""
        flight = self.flights[rid]
        try:
            response = encoded.result()
        except DecodeFailed as failed:
            logger.error("request %s: its images could not be made", rid, exc_info=failed.error)
            return self.fail(rid, internal_error(DecodeFailed.stage, failed.error))
        except Exception as error:
            logger.exception("request %s could not be encoded", rid, exc_info=error)
            return self.fail(rid, internal_error("encoding", error))
        del self.flights[rid]
        self._answered.append((flight.arrived, encoding.metadata["timings"]["encode_s"]))
        return self.part(flight, response.body, final=True, response=response)

    def fail(self, rid: str, response: Response) -> Response:
        """A request's error answer in its API's shape (in a stream: as its last line)."""
        flight = self.flights.pop(rid)
        self._answered.append((flight.arrived, None))
        response = flight.api.error(response)
        body = flight.api.stream_error(response, flight.parts_sent == 0) if flight.request.stream else response.body
        return self.part(flight, body, final=True, response=response)

    def part(self, flight: Flight, body: bytes, final: bool, response: Response | None = None) -> Response:
        """A part of a request's answer. Its first part carries the status, content type and
        headers: those of ``response`` when it ends the request, else 200 and the type of the
        request's answer (TorchServe has sent them when a later part fails)."""
        first = flight.parts_sent == 0
        flight.parts_sent += 1
        if first and response is not None:
            return replace(response, body=body, final=final, first=True)
        api, request = flight.api, flight.request
        return Response(200, body, api.content_type(request), api.headers(request) if first else {}, final, first)

    def delivered(self) -> None:
        """Record the latency of the requests answered since the last call, now that their
        answers leave the worker (with dynamic batching, with their whole batch)."""
        now = self.clock()
        for arrived, encode_seconds in self._answered:
            self.metrics.request_completed(now - arrived, encode_seconds)
        self._answered.clear()
        self.metrics.queue(self.flights.gauges())


def joined(earlier: Response, later: Response) -> Response:
    """Two parts of one request's answer from one call as one: the first's status and headers."""
    return replace(earlier, body=earlier.body + later.body, final=later.final)


def _answer(
    api: Api, request: GenerationRequest, decode: LaterDecode, rows: slice, metadata: dict[str, Any]
) -> Response:
    """A request's answer: its ``rows`` of ``decode`` (made here where no one has), encoded."""
    made = decode.result()  # DecodeFailed where the images could not be made
    images = made.decoded.rows(rows)
    metadata["nsfw_content_detected"] = images.nsfw_content_detected
    metadata["timings"]["vae_decode_s"] = round(made.seconds, 6)
    return api.success(request, images.images, metadata)
