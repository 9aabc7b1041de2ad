"""Continuous batching: requests join and leave the running batch between denoising steps.

The server calls ``ContinuousService.iterate`` once per iteration with the requests now in flight
(new ones with their bodies). Each iteration decodes and starts the new requests, picks which
requests take the next step (least deadline slack first, at most the batch the measured step-time
profile allows for their latent shape), runs ONE UNet forward for them, decodes the finished ones
with one VAE call, and returns one ``Chunk`` per request: the final response, a progress event for
streaming requests, or nothing yet.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from handler.batching import CallInputs, CallKey, PipelineCall
from handler.config import HandlerSettings
from handler.encode import JSON_CONTENT_TYPE, encode_image, images_json, json_body
from handler.metrics import DiffusionMetrics, MetricSink
from handler.pipeline import synchronize
from handler.request import GenerationRequest, RequestError, RequestPolicy
from handler.service import (
    SEED_HEADER,
    IncomingRequest,
    Response,
    bad_request,
    decode,
    encode_response,
    internal_error,
    load_engine,
    release_cached_memory,
    success_content_type,
)
from handler.stepping import DenoiseJob, StepEngine

logger = logging.getLogger(__name__)

STREAM_CONTENT_TYPE = "application/x-ndjson"
# A larger batch is worth it while it cuts the per-image step time by at least this fraction.
PROFILE_GAIN = 0.05


@dataclass(frozen=True)
class Chunk:
    """What one request gets from one iteration. The status, content type and headers of a
    request's first chunk are the ones its client sees (TorchServe sends them with it)."""

    body: bytes
    final: bool
    first: bool = True
    status: int = 200
    content_type: str = JSON_CONTENT_TYPE
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Flight:
    """One admitted request on its way through the denoising loop."""

    request: GenerationRequest
    job: DenoiseJob
    arrived: float
    deadline: float
    chunks_sent: int = 0

    def content_type(self) -> str:
        return STREAM_CONTENT_TYPE if self.request.stream else success_content_type(self.request)


class StepProfile:
    """Measured seconds of one step per latent shape and batch (in images), and the batch cap it
    implies: the smallest batch whose per-image step time is within ``PROFILE_GAIN`` of the best.
    Beyond it a larger batch only adds latency, so the engine never steps more images at once."""

    def __init__(self, stepper: StepEngine, max_images: int):
        self.stepper = stepper
        self.max_images = max_images
        self.seconds: dict[tuple, dict[int, float]] = {}
        self.memory_caps: dict[tuple, int] = {}

    def measure(self, key: CallKey) -> dict[int, float]:
        """Time one step at batch 1, 2, 4, ... up to ``max_images`` for ``key``'s latent shape."""
        sizes, size = [], 1
        while size < self.max_images:
            sizes.append(size)
            size *= 2
        sizes.append(self.max_images)
        timings = {}
        shape = self.stepper.latent_shape(key)
        for size in sizes:
            job = self.stepper.start(key, CallInputs(["profile"] * size, [""] * size, list(range(size)), [0] * size))
            try:
                self.stepper.step([job])  # first call at a size may allocate or compile
                started = time.perf_counter()
                self.stepper.step([job])
                synchronize(self.stepper.device)
            except torch.OutOfMemoryError:
                release_cached_memory()
                self.lower_cap(shape, max(1, size // 2))
                break
            timings[size] = time.perf_counter() - started
        self.seconds[shape] = timings
        logger.info("step-time profile %s: %s; cap %d images", shape, {k: round(v, 4) for k, v in timings.items()}, self.cap(shape))
        return timings

    def cap(self, shape: tuple) -> int:
        timings = self.seconds.get(shape)
        if not timings:
            return min(self.max_images, self.memory_caps.get(shape, self.max_images))
        best = min(seconds / size for size, seconds in timings.items())
        fastest = min(size for size, seconds in timings.items() if seconds / size <= best * (1 + PROFILE_GAIN))
        return max(1, min(fastest, self.memory_caps.get(shape, fastest)))

    def lower_cap(self, shape: tuple, images: int) -> None:
        """After running out of memory at a larger batch: never step more than ``images`` again."""
        self.memory_caps[shape] = max(1, min(images, self.memory_caps.get(shape, images)))

    def step_seconds(self, shape: tuple, images: int) -> float:
        """Estimated seconds of one step of ``images`` images (nearest measured batch at or above)."""
        timings = self.seconds.get(shape)
        if not timings:
            return 0.0
        size = min((size for size in timings if size >= images), default=max(timings))
        return timings[size]


class ContinuousService:
    """Runs in-flight requests step by step with a ``StepEngine``."""

    def __init__(
        self, stepper: StepEngine, policy: RequestPolicy, profile: StepProfile, metrics: DiffusionMetrics,
        latency_sla_seconds: float, log_prompts: bool = False, clock: Callable[[], float] = time.perf_counter,
    ):
        self.stepper = stepper
        self.policy = policy
        self.profile = profile
        self.metrics = metrics
        self.sla = latency_sla_seconds
        self.log_prompts = log_prompts
        self.clock = clock
        self.flights: dict[str, Flight] = {}

    def iterate(self, new: dict[str, IncomingRequest], in_flight: list[str]) -> dict[str, Chunk]:
        """One iteration for the requests ``in_flight`` (ids), of which ``new`` arrived now."""
        for gone in set(self.flights) - set(in_flight):
            logger.info("request %s left before it finished (client gone); dropping it", gone)
            del self.flights[gone]
        chunks = self._admit(new)
        self.metrics.in_flight(len(self.flights))
        chosen = self._choose()
        if chosen:
            chunks.update(self._step(chosen))
        chunks.update(self._finish([rid for rid, flight in self.flights.items() if flight.job.done]))
        for rid in in_flight:
            if rid not in chunks and rid in self.flights:
                chunks[rid] = self._nothing_yet(self.flights[rid])
        return chunks

    def _admit(self, new: dict[str, IncomingRequest]) -> dict[str, Chunk]:
        chunks = {}
        for rid, incoming in new.items():
            arrived = self.clock()
            try:
                request = decode(incoming, self.policy)
                key = CallKey.of(request)
                if self.profile.seconds.get(self.stepper.latent_shape(key)) is None:
                    self.profile.measure(key)
                job = self.stepper.start(key, CallInputs.of(PipelineCall(key, (0,)), {0: request}))
            except RequestError as error:
                self.metrics.request_rejected([item.field for item in error.errors])
                chunks[rid] = _as_chunk(bad_request(error))
                continue
            except Exception as error:  # one request's failure must not fail the others
                logger.exception("request %s could not be started", rid)
                chunks[rid] = _as_chunk(internal_error("admission", error))
                continue
            if self.log_prompts:
                logger.info("request %s: %s", rid, request.parameters())
            self.flights[rid] = Flight(request, job, arrived, arrived + self.sla)
        return chunks

    def slack(self, flight: Flight, now: float) -> float:
        """Seconds to spare: time to the deadline minus the estimated time of the remaining steps."""
        shape = flight.job.latent_shape
        per_step = self.profile.step_seconds(shape, self.profile.cap(shape))
        return flight.deadline - now - (flight.job.total_steps - flight.job.step) * per_step

    def _choose(self) -> list[str]:
        """The requests that take this iteration's step: the latent shape of the request with the
        least slack, and within it the least-slack requests up to the profile's image cap."""
        waiting = {rid: flight for rid, flight in self.flights.items() if not flight.job.done}
        if not waiting:
            return []
        now = self.clock()
        order = sorted(waiting, key=lambda rid: self.slack(waiting[rid], now))
        shape = waiting[order[0]].job.latent_shape
        cap, images, chosen = self.profile.cap(shape), 0, []
        for rid in order:
            job = waiting[rid].job
            if job.latent_shape != shape:
                continue
            size = job.latents.shape[0]
            if chosen and images + size > cap:
                break
            chosen.append(rid)
            images += size
        return chosen

    def _step(self, chosen: list[str]) -> dict[str, Chunk]:
        jobs = [self.flights[rid].job for rid in chosen]
        started = time.perf_counter()
        chunks = self._step_or_split(chosen)
        stepped = [job for rid, job in zip(chosen, jobs) if rid not in chunks]
        if stepped:
            self.metrics.iteration(sum(job.latents.shape[0] for job in stepped), time.perf_counter() - started)
        now = self.clock()
        for rid in chosen:
            flight = self.flights.get(rid)
            if rid not in chunks and flight.request.stream and not flight.job.done:
                chunks[rid] = self._progress(flight, now)
        return chunks

    def _step_or_split(self, chosen: list[str]) -> dict[str, Chunk]:
        """One step for ``chosen``; out of memory halves the group (and the shape's cap) and
        retries each half, so only a request that does not fit alone fails. Failures by id."""
        jobs = [self.flights[rid].job for rid in chosen]
        try:
            self.stepper.step(jobs)
            synchronize(self.stepper.device)
            return {}
        except torch.OutOfMemoryError as error:
            if len(chosen) == 1:
                logger.error("request %s does not fit in memory even alone: %s", chosen[0], error)
                return {chosen[0]: self._fail(chosen[0], "generation", error)}
            logger.warning("out of memory stepping requests %s; retrying in two halves", chosen)
            self.metrics.out_of_memory_retry()
            release_cached_memory()
            self.profile.lower_cap(jobs[0].latent_shape, sum(job.latents.shape[0] for job in jobs) // 2)
            middle = len(chosen) // 2
            return {**self._step_or_split(chosen[:middle]), **self._step_or_split(chosen[middle:])}
        except Exception as error:  # one failing step must not fail the requests that did not take it
            logger.exception("denoising step for requests %s failed", chosen)
            return {rid: self._fail(rid, "generation", error) for rid in chosen}

    def _finish(self, done: list[str]) -> dict[str, Chunk]:
        chunks = {}
        by_shape: dict[tuple, list[str]] = {}
        for rid in done:
            by_shape.setdefault(self.flights[rid].job.latent_shape, []).append(rid)
        for rids in by_shape.values():
            try:
                images = self.stepper.finish([self.flights[rid].job for rid in rids])
            except Exception as error:
                logger.exception("VAE decode for requests %s failed", rids)
                chunks.update({rid: self._fail(rid, "decoding", error) for rid in rids})
                continue
            self.metrics.images_generated(sum(len(own) for own in images))
            for rid, own in zip(rids, images):
                chunks[rid] = self._final(rid, own)
        return chunks

    def _final(self, rid: str, images: list) -> Chunk:
        flight = self.flights.pop(rid)
        elapsed = self.clock() - flight.arrived
        metadata = {
            "seed": flight.request.seed,
            "parameters": flight.request.parameters(),
            "timings": {"total_s": round(elapsed, 6)},
        }
        encode_started = time.perf_counter()
        try:
            if flight.request.stream:
                encoded = [encode_image(image, flight.request.output_format) for image in images]
                done = {"event": "done", "format": flight.request.output_format, **metadata}
                response = Response(200, images_json(encoded, done) + b"\n", STREAM_CONTENT_TYPE, {})
            else:
                response = encode_response(flight.request, images, metadata)
        except Exception as error:
            logger.exception("request %s could not be encoded", rid)
            self.flights[rid] = flight
            return self._fail(rid, "encoding", error)
        self.metrics.request_completed(elapsed, time.perf_counter() - encode_started)
        if elapsed > self.sla:
            self.metrics.deadline_missed()
        return self._chunk(flight, response.body, True, response)

    def _fail(self, rid: str, stage: str, error: Exception) -> Chunk:
        flight = self.flights.pop(rid)
        response = internal_error(stage, error)
        body = _event({"event": "error", **json.loads(response.body)}) if flight.request.stream else response.body
        return self._chunk(flight, body, True, response)

    def _progress(self, flight: Flight, now: float) -> Chunk:
        event = {"event": "progress", "step": flight.job.step, "total_steps": flight.job.total_steps,
                 "elapsed_s": round(now - flight.arrived, 6)}
        return self._chunk(flight, _event(event), False)

    def _nothing_yet(self, flight: Flight) -> Chunk:
        return self._chunk(flight, b"", False)

    def _chunk(self, flight: Flight, body: bytes, final: bool, response: Response | None = None) -> Chunk:
        """The first chunk of a request carries its status and content type: 200 and the type
        of its final body, or the response itself when it ends in its first iteration."""
        first = flight.chunks_sent == 0
        flight.chunks_sent += 1
        if first and response is not None:
            return Chunk(body, final, first, response.status, response.content_type, response.headers)
        headers = {SEED_HEADER: str(flight.request.seed)} if first else {}
        return Chunk(body, final, first, 200, flight.content_type(), headers)


def build_continuous_service(
    settings: HandlerSettings, model_dir: str | Path, sink: MetricSink, gpu_id: int | None = None
) -> tuple[ContinuousService, HandlerSettings]:
    """Load the pipeline and build the continuous-batching service as a worker does."""
    engine, settings = load_engine(settings, model_dir, gpu_id)
    stepper = StepEngine(engine)
    sla = settings.metrics.latency_sla_seconds
    service = ContinuousService(
        stepper,
        RequestPolicy(settings.limits, settings.defaults, streaming=True),
        StepProfile(stepper, settings.max_images_per_call),
        DiffusionMetrics(sink, sla),
        sla,
        settings.log_prompts,
    )
    return service, settings


def _as_chunk(response: Response) -> Chunk:
    return Chunk(response.body, True, True, response.status, response.content_type, response.headers)


def _event(payload: dict) -> bytes:
    return json_body(payload) + b"\n"
