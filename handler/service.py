"""One service for both TorchServe batching modes: admit, step, finish, answer.

Requests become jobs of the step engine at admission: decoding and validation, the memory check,
text encoding (one call for the requests admitted together), the job's scheduler and latents.
Everything that can fail for a request's own reasons fails there, with its own status. Then
iterations: ``choose`` picks the jobs of one latent shape for ONE denoiser forward whatever their
steps, scheduler and guidance, and finished jobs are decoded together and answered.
TorchServe's two modes are two loops over the same iteration:

- dynamic batching (``run_batch``): a batch is admitted, then iterated until every job is done;
- continuous batching (``iterate``): one iteration per call; requests join and leave between
  steps, and streamed requests get a progress line per step.

Every request gets exactly one final ``Response``; a bad or failing request never fails the others.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from handler.config import HandlerSettings, WarmupShape
from handler.controlnets import ControlNetError, ControlSpec
from handler.engine import DenoiseJob, JobSpec, StepEngine
from handler.families import Decoded
from handler.loras import Adapters, LoraBusy, LoraError
from handler.metrics import DiffusionMetrics, MetricSink, QueueGauges
from handler.pipeline import load_engine, release_cached_memory, synchronize
from handler.protocol import (
    Api,
    IncomingRequest,
    Preview,
    Response,
    bad_request,
    busy,
    deadline_exceeded,
    does_not_fit,
    internal_error,
    shutting_down,
)
from handler.request import GenerationRequest, RequestError, RequestPolicy
from handler.routes import route
from handler.scheduling import StepProfile, choose, slack

logger = logging.getLogger(__name__)


def job_spec(request: GenerationRequest, adapters: Adapters = (), nets: tuple[str, ...] = ()) -> JobSpec:
    """What the engine generates for a validated request (image k from seed + k), with its LoRA
    adapters and ControlNets (``nets``: ids, one per ``request.controlnets``) as the engine's
    libraries resolved them."""
    return JobSpec(
        request.prompt,
        request.negative_prompt,
        tuple(request.image_seeds()),
        request.width,
        request.height,
        request.num_inference_steps,
        request.scheduler,
        request.guidance_scale,
        request.image,
        request.mask,
        1.0 if request.strength is None else request.strength,
        adapters,
        tuple(
            ControlSpec(net, choice.image, choice.scale, choice.start, choice.end)
            for net, choice in zip(nets, request.controlnets, strict=True)
        ),
    )


@dataclass
class Flight:
    """One admitted request on its way through the denoising loop, and the API it answers in."""

    api: Api
    request: GenerationRequest
    job: DenoiseJob
    arrived: float
    admitted: float
    deadline: float  # the latency SLA: what slack is measured against
    expires: float  # the time limit: past it the request is cancelled
    admitted_with: int  # requests admitted together, itself included
    over_grpc: bool = False
    denoised: float = 0.0
    max_step_images: int = 0
    parts_sent: int = 0


class DiffusionService:
    """Serves text-to-image requests with one step engine, in either batching mode."""

    def __init__(
        self,
        engine: StepEngine,
        policy: RequestPolicy,
        profile: StepProfile,
        metrics: DiffusionMetrics,
        latency_sla_seconds: float,
        log_prompts: bool = False,
        iteration_budget_seconds: float = 0.0,
        synchronize_steps: bool = True,
        request_timeout_seconds: float = math.inf,
        batch_size: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
        drain_left: Callable[[], float | None] = lambda: None,
    ):
        self.engine = engine
        self.policy = policy
        self.profile = profile
        self.metrics = metrics
        self.sla = latency_sla_seconds
        self.log_prompts = log_prompts
        self.iteration_budget = iteration_budget_seconds
        self.synchronize_steps = synchronize_steps
        self.request_timeout = request_timeout_seconds
        self.batch_size = batch_size  # TorchServe's: with continuous batching, the most requests in flight
        self.clock = clock
        # While the server is stopping, the seconds left to answer every request (None otherwise).
        self.drain_left = drain_left
        self.flights: dict[str, Flight] = {}
        self._waiting = 0  # requests left out of the last forward
        # (arrived, encode seconds; None for a failure) of the requests answered since the last delivery
        self._answered: list[tuple[float, float | None]] = []

    # The two loops TorchServe's modes run.

    def run_batch(self, requests: dict[str, IncomingRequest]) -> dict[str, Response]:
        """Dynamic batching: admit the batch and iterate until every job is done."""
        try:
            responses = self._admit(requests)
            while self.flights:
                responses.update(self._iteration())
        finally:  # an unexpected error fails this batch (TorchServe answers it); the next starts clean
            self.flights.clear()
            self._waiting = 0
            self._delivered()
        return responses

    def iterate(self, requests: dict[str, IncomingRequest]) -> dict[str, Response]:
        """Continuous batching: iterations for the requests TorchServe has in flight (by id), ids
        not seen before admitted first, until ``_call_done``. One ``Response`` per id: an empty
        body while a request that is not streamed is still denoising. A flight whose id is
        missing lost its client."""
        for gone in set(self.flights) - set(requests):
            logger.info("request %s left before it finished (client gone); dropping it", gone)
            del self.flights[gone]
            self.metrics.cancelled("client_gone")
        started = self.clock()
        responses = self._admit({rid: incoming for rid, incoming in requests.items() if rid not in self.flights})
        while True:
            for rid, response in self._iteration().items():
                responses[rid] = _joined(responses[rid], response) if rid in responses else response
            if self._call_done(started, responses):
                break
        for rid in requests:
            if rid not in responses:
                responses[rid] = self._part(self.flights[rid], b"", final=False)
        self._delivered()
        return responses

    def _call_done(self, started: float, responses: dict[str, Response]) -> bool:
        """Whether a continuous-batching call returns now. Never while a gRPC request is unfinished:
        TorchServe 0.12 ends a gRPC call with the first part of its answer, so that answer must
        leave whole. Else when a request finished or none is left, or when the iteration budget is
        spent and a new call helps someone: a request could join (fewer in flight than
        TorchServe's batch size) or a streamed request awaits its progress lines. A full batch
        without a stream keeps stepping: TorchServe would let no request join, so a return would
        only cost a round trip."""
        if any(flight.over_grpc for flight in self.flights.values()):
            return False
        if not self.flights or any(response.final for response in responses.values()):
            return True
        if self.clock() - started < self.iteration_budget:
            return False
        full = self.batch_size is not None and len(self.flights) >= self.batch_size
        return not full or any(flight.request.stream for flight in self.flights.values())

    def warm_up(self, shapes: tuple[WarmupShape, ...]) -> float:
        """Profile each shape's step times, then run one job of it through start, steps and
        decode, so that the first request pays no allocation or compilation (in a compiled
        denoiser with LoRA slots, a second job compiles the graph with LoRA rows). Returns seconds."""
        started = time.perf_counter()
        for shape in shapes:
            self.profile.measure(shape.width, shape.height)
            if not self.profile.fits(self.engine.latent_shape(shape.width, shape.height), shape.batch_size):
                logger.warning("warm-up shape %s does not fit in memory; skipped", shape.model_dump())
                continue
            self._warm_up_job(shape)
            if self.engine.loras.slots is not None:
                with self.engine.loras.slots.lora_graph():
                    self._warm_up_job(shape)
        return time.perf_counter() - started

    def _warm_up_job(self, shape: WarmupShape) -> None:
        defaults = self.policy.defaults
        spec = JobSpec(
            "warm-up",
            None,
            tuple(range(shape.batch_size)),
            shape.width,
            shape.height,
            shape.num_inference_steps,
            defaults.scheduler,
            defaults.guidance_scale,
        )
        (job,) = self.engine.start([spec])
        while not job.done:
            self.engine.step([job])
        self.engine.decode(job.latents, shape.width, shape.height)

    # Admission.

    def _admit(self, new: dict[str, IncomingRequest]) -> dict[str, Response]:
        """Decode, validate and start new requests together; those that cannot start get their answer now."""
        if not new:
            return {}
        self.metrics.batch_received(len(new))
        # Counted in the worker from now on: a stopping server waits for them (server.process.drain).
        self.metrics.queue(replace(self._queue(), requests=len(self.flights) + len(new)))
        responses: dict[str, Response] = {}
        valid: dict[str, GenerationRequest] = {}
        arrived = self.clock()
        apis: dict[str, Api] = {}
        draining = self.drain_left() is not None
        for rid, incoming in new.items():
            outcome = self._validate(rid, incoming, draining)
            if isinstance(outcome, Response):
                responses[rid] = outcome
            else:
                apis[rid], valid[rid] = outcome
        for rid, started in self._start(valid).items():
            if isinstance(started, Response):
                responses[rid] = apis[rid].error(started)
            else:
                self.flights[rid] = Flight(
                    apis[rid],
                    valid[rid],
                    started,
                    arrived,
                    self.clock(),
                    arrived + self.sla,
                    arrived + self.request_timeout,
                    len(new),
                    new[rid].over_grpc,
                )
        return responses

    def _validate(
        self, rid: str, incoming: IncomingRequest, draining: bool = False
    ) -> tuple[Api, GenerationRequest] | Response:
        """The request's API and the validated request, or its whole answer (an error, a route
        that generates nothing, or while the server is stopping 503 with ``Retry-After``)."""
        api = route(incoming.path, self.policy.model_name, self._extensions)
        if isinstance(api, Response):
            return api
        if draining:
            logger.info("request %s refused: the server is stopping", rid)
            return api.error(shutting_down())
        try:
            request = api.decode(incoming, self.policy)
        except RequestError as error:
            labels = [item.label(api.field_labels) for item in error.errors]
            rejected = ", ".join(f"{label} ({item.rule})" for label, item in zip(labels, error.errors, strict=True))
            logger.info("request %s rejected: %s", rid, rejected)
            self.metrics.request_rejected(labels)
            return api.error(bad_request(error))
        except Exception as error:  # a bug must cost this request only, not its batchmates
            logger.exception("request %s could not be decoded", rid)
            return api.error(internal_error("decoding", error))
        if self.log_prompts:
            logger.info("request %s: %s", rid, request.parameters())
        return api, request

    def _start(self, requests: dict[str, GenerationRequest]) -> dict[str, DenoiseJob | Response]:
        """Jobs for the requests, started together; 400 for a LoRA that cannot be served, 507 for a
        request whose shape and image count already ran out of memory alone (a shape seen for the
        first time is profiled first)."""
        outcomes: dict[str, DenoiseJob | Response] = {}
        specs: dict[str, JobSpec] = {}
        for rid, request in requests.items():
            adapters = self._adapters(rid, request, specs.values())
            if isinstance(adapters, Response):
                outcomes[rid] = adapters
                continue
            nets = self._controlnets(rid, request, specs.values())
            if isinstance(nets, Response):
                outcomes[rid] = nets
                continue
            spec = job_spec(request, adapters, nets)
            try:
                fits = self._fits(spec)
            except Exception as error:  # out of memory (507) or a failure while profiling (500)
                logger.exception("request %s could not be started", rid)
                release_cached_memory()
                outcomes[rid] = internal_error("admission", error)
                continue
            if fits:
                specs[rid] = spec
            else:
                logger.warning(
                    "request %s does not fit in memory (%d image(s) of %dx%d)",
                    rid,
                    request.num_images_per_prompt,
                    request.width,
                    request.height,
                )
                outcomes[rid] = does_not_fit(request)
        outcomes.update(self._start_together(specs))
        return outcomes

    def _extensions(self) -> dict[str, list[dict[str, Any]]]:
        """The LoRAs and ControlNets a request may name now."""
        return {
            "loras": [file.describe() for file in self.engine.loras.available()],
            "controlnets": [item.describe() for item in self.engine.controlnets.available()],
        }

    def _specs_in_use(self, starting: Iterable[JobSpec]) -> list[JobSpec]:
        """The jobs whose LoRAs and ControlNets must stay loaded: those starting and those in flight."""
        return [*starting, *(flight.job.spec for flight in self.flights.values())]

    def _controlnets(
        self, rid: str, request: GenerationRequest, starting: Iterable[JobSpec]
    ) -> tuple[str, ...] | Response:
        """The ids of the request's ControlNets, loaded where needed (keeping those of the jobs in
        flight and starting), or its 400."""
        if not request.controlnets:
            return ()
        in_use = {control.net for spec in self._specs_in_use(starting) for control in spec.controls}
        try:
            nets = self.engine.controlnets.acquire([choice.name for choice in request.controlnets], in_use)
        except ControlNetError as error:
            logger.info("request %s rejected: controlnets (%s)", rid, error.rule)
            self.metrics.request_rejected(["controlnets"])
            return bad_request(RequestError.single("controlnets", error.rule, str(error)))
        finally:
            self.metrics.controlnets_loaded(self.engine.controlnets.loaded)
        self.metrics.controlnet_requests([choice.name for choice in request.controlnets])
        return tuple(nets)

    def _adapters(self, rid: str, request: GenerationRequest, starting: Iterable[JobSpec]) -> Adapters | Response:
        """The request's LoRA adapters, loaded where needed (keeping those of the jobs in flight and
        starting), or its 400."""
        if not request.loras:
            return ()
        in_use = {adapter for spec in self._specs_in_use(starting) for adapter, _ in spec.adapters}
        try:
            adapters = self.engine.loras.acquire([(lora.name, lora.scale) for lora in request.loras], in_use)
        except LoraError as error:
            logger.info("request %s rejected: loras (%s)", rid, error.rule)
            self.metrics.request_rejected(["loras"])
            return bad_request(RequestError.single("loras", error.rule, str(error)))
        except LoraBusy as error:
            logger.info("request %s refused: %s", rid, error)
            return busy(str(error))
        finally:
            self.metrics.loras_loaded(self.engine.loras.loaded)
        self.metrics.lora_requests([lora.name for lora in request.loras])
        return adapters

    def _fits(self, spec: JobSpec) -> bool:
        """False when a job of its shape and rows already ran out of memory alone."""
        shape = self.engine.latent_shape(spec.width, spec.height)
        if not self.profile.measured(shape):
            self.profile.measure(spec.width, spec.height)
        return self.profile.fits(shape, spec.rows)

    def _start_together(self, specs: dict[str, JobSpec]) -> dict[str, DenoiseJob | Response]:
        """Start jobs together (one text-encoder call); when that fails, each alone, so that a
        failure (out of memory: 507, else 500) costs only its own request."""
        if not specs:
            return {}
        try:
            return dict(zip(specs, self.engine.start(list(specs.values())), strict=True))
        except Exception as error:
            if len(specs) == 1:
                (rid,) = specs
                logger.exception("request %s could not be started", rid)
                return {rid: internal_error("admission", error)}
            logger.warning("starting requests %s together failed (%s); starting each alone", list(specs), error)
        release_cached_memory()  # outside the except block, whose traceback holds the failed call's tensors
        outcomes: dict[str, DenoiseJob | Response] = {}
        for rid, spec in specs.items():
            outcomes.update(self._start_together({rid: spec}))
        return outcomes

    # One iteration: step the chosen jobs, decode the finished ones.

    def _iteration(self) -> dict[str, Response]:
        """Cancel what would pass its time limit, step the chosen jobs, decode the finished ones."""
        responses = self._cancel_expired()
        waiting = {rid: flight.job for rid, flight in self.flights.items() if not flight.job.done}
        chosen: list[str] = []
        if waiting:
            now = self.clock()
            slacks = {rid: slack(job, self.flights[rid].deadline, now, self.profile) for rid, job in waiting.items()}
            chosen = choose(waiting, slacks, self.profile.cap)
            responses.update(self._step(chosen))
        self._waiting = len(waiting) - len(chosen)
        responses.update(self._finish([rid for rid, flight in self.flights.items() if flight.job.done]))
        self.metrics.queue(self._queue())
        return responses

    def _cancel_expired(self) -> dict[str, Response]:
        """For the unfinished jobs whose next step (by the profile's estimate) would end past their
        time limit, 504; past the end of the server's stop grace period, 503."""
        now, responses = self.clock(), {}
        drain_left = self.drain_left()
        for rid, flight in list(self.flights.items()):
            job = flight.job
            step_seconds = self.profile.forward_seconds(job.latent_shape)
            if not job.done and drain_left is not None and step_seconds >= drain_left:
                logger.warning(
                    "request %s cancelled after %d of %d steps: the server is stopping and its grace period ends",
                    rid,
                    job.step,
                    job.total_steps,
                )
                self.metrics.cancelled("shutdown")
                responses[rid] = self._fail(rid, shutting_down((job.step, job.total_steps)))
                continue
            if job.done or now + step_seconds < flight.expires:
                continue
            logger.warning(
                "request %s cancelled after %d of %d steps: past its time limit of %g s",
                rid,
                job.step,
                job.total_steps,
                self.request_timeout,
            )
            self.metrics.cancelled("deadline")
            responses[rid] = self._fail(rid, deadline_exceeded(job.step, job.total_steps, self.request_timeout))
        return responses

    def _queue(self) -> QueueGauges:
        """The worker's queue now: requests and images in flight, and those the last forward left out."""
        return QueueGauges(len(self.flights), sum(flight.job.images for flight in self.flights.values()), self._waiting)

    def _step(self, chosen: list[str]) -> dict[str, Response]:
        """One denoiser forward for ``chosen``. Out of memory halves the jobs that did not advance (and
        the shape's cap) and retries each half, so only a job that does not fit alone fails.
        Returns failures and progress lines by id."""
        jobs = [self.flights[rid].job for rid in chosen]
        steps_before = [job.step for job in jobs]
        rows = sum(job.rows for job in jobs)
        started = time.perf_counter()
        try:
            control_forwards = self.engine.step(jobs)
            if self.synchronize_steps:
                synchronize(self.engine.device)
        except torch.OutOfMemoryError as error:
            out_of_memory = error
        except Exception as error:  # one failing step must not fail the requests that did not take it
            logger.exception("denoising step for requests %s failed", chosen)
            return {rid: self._fail(rid, internal_error("denoising", error)) for rid in chosen}
        else:
            return self._stepped(chosen, control_forwards, time.perf_counter() - started)
        # Retried outside the except block, whose traceback would keep the failed forward's tensors alive.
        release_cached_memory()
        pending = [rid for rid, job, step in zip(chosen, jobs, steps_before, strict=True) if job.step == step]
        self.profile.ran_out_of_memory(jobs[0].latent_shape, rows, alone=len(chosen) == 1)
        if len(chosen) == 1:
            logger.error("request %s does not fit in memory even alone: %s", chosen[0], out_of_memory)
            return {chosen[0]: self._fail(chosen[0], does_not_fit(self.flights[chosen[0]].request))}
        logger.warning("out of memory stepping requests %s; retrying %s in two halves", chosen, pending)
        self.metrics.out_of_memory_retry("step")
        middle = len(pending) // 2
        halves = [half for half in (pending[:middle], pending[middle:]) if half]
        return {rid: response for half in halves for rid, response in self._step(half).items()}

    def _stepped(self, chosen: list[str], control_forwards: int, seconds: float) -> dict[str, Response]:
        """Bookkeeping of a forward that went through: metrics, progress lines, finish times."""
        images = sum(self.flights[rid].job.images for rid in chosen)
        adapters = {adapter for rid in chosen for adapter, _ in self.flights[rid].job.spec.adapters}
        self.metrics.step(images, len(adapters), control_forwards, seconds)
        now, responses = self.clock(), {}
        for rid in chosen:
            flight = self.flights[rid]
            flight.max_step_images = max(flight.max_step_images, images)
            if flight.job.done:
                flight.denoised = now
            elif flight.request.stream:
                part = flight.api.progress(
                    flight.request, flight.job.step, flight.job.total_steps, now - flight.arrived, self._preview(rid)
                )
                if part:
                    responses[rid] = self._part(flight, part, final=False)
        return responses

    def _preview(self, rid: str) -> Preview:
        """A request's images decoded from its latents as they are when called (safety checker
        included); none where that decode fails (a preview is not worth a request or a batch)."""
        job = self.flights[rid].job

        def preview() -> list:
            try:
                return self.engine.decode(job.latents, job.spec.width, job.spec.height).images
            except Exception as error:  # out of memory included: the request goes on without this preview
                logger.warning("preview of request %s skipped: %s: %s", rid, type(error).__name__, error)
                release_cached_memory()
                return []

        return preview

    def _finish(self, done: list[str]) -> dict[str, Response]:
        """Decode finished jobs, one VAE call per latent shape, and answer them."""
        by_shape: dict[tuple, list[str]] = {}
        for rid in done:
            by_shape.setdefault(self.flights[rid].job.latent_shape, []).append(rid)
        responses = {}
        for rids in by_shape.values():
            started = time.perf_counter()
            decoded = self._decode(rids)
            seconds = time.perf_counter() - started
            images = sum(len(result.images) for result in decoded.values() if isinstance(result, Decoded))
            if images:
                self.metrics.decoded(images, seconds)
            for rid, result in decoded.items():
                responses[rid] = (
                    self._final(rid, result, seconds) if isinstance(result, Decoded) else self._fail(rid, result)
                )
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

    # Answers.

    def _final(self, rid: str, decoded: Decoded, decode_seconds: float) -> Response:
        flight = self.flights[rid]
        metadata: dict[str, Any] = {
            "seed": flight.request.seed,
            "parameters": flight.request.parameters(),
            "nsfw_content_detected": decoded.nsfw_content_detected,
            "batch": {"requests": flight.admitted_with, "max_step_images": flight.max_step_images},
            "timings": {
                "admission_s": round(flight.admitted - flight.arrived, 6),
                "denoise_s": round(flight.denoised - flight.admitted, 6),
                "vae_decode_s": round(decode_seconds, 6),
            },
        }
        try:
            response = flight.api.success(flight.request, decoded.images, metadata)
        except Exception as error:
            logger.exception("request %s could not be encoded", rid)
            return self._fail(rid, internal_error("encoding", error))
        del self.flights[rid]
        self._answered.append((flight.arrived, metadata["timings"]["encode_s"]))
        return self._part(flight, response.body, final=True, response=response)

    def _fail(self, rid: str, response: Response) -> Response:
        flight = self.flights.pop(rid)
        self._answered.append((flight.arrived, None))
        response = flight.api.error(response)
        body = flight.api.stream_error(response, flight.parts_sent == 0) if flight.request.stream else response.body
        return self._part(flight, body, final=True, response=response)

    def _part(self, flight: Flight, body: bytes, final: bool, response: Response | None = None) -> Response:
        """A part of a request's answer. Its first part carries the status, content type and
        headers: those of ``response`` when it ends the request, else 200 and the type of the
        request's answer (TorchServe has sent them when a later part fails)."""
        first = flight.parts_sent == 0
        flight.parts_sent += 1
        if first and response is not None:
            return replace(response, body=body, final=final, first=True)
        api, request = flight.api, flight.request
        return Response(200, body, api.content_type(request), api.headers(request) if first else {}, final, first)

    def _delivered(self) -> None:
        """Record the latency of the requests answered since the last call, now that their
        answers leave the worker (with dynamic batching, with their whole batch)."""
        now = self.clock()
        for arrived, encode_seconds in self._answered:
            self.metrics.request_completed(now - arrived, encode_seconds)
        self._answered.clear()
        self.metrics.queue(self._queue())


def _joined(earlier: Response, later: Response) -> Response:
    """Two parts of one request's answer from one call as one: the first's status and headers."""
    return replace(earlier, body=earlier.body + later.body, final=later.final)


def build_service(
    settings: HandlerSettings,
    model_dir: str | Path,
    sink: MetricSink,
    gpu_id: int | None = None,
    streaming: bool = False,
    batch_size: int | None = None,
    worker: str = "0",
    model_name: str = "stable-diffusion",
    drain_left: Callable[[], float | None] = lambda: None,
) -> tuple[DiffusionService, HandlerSettings]:
    """Load the pipeline and build the service exactly as a worker does (the handler, the
    benchmarks and the tests share this); return it with the settings resolved for the model
    (``HandlerSettings.for_model``). ``streaming``: continuous batching, which can stream progress;
    ``batch_size``: TorchServe's; ``worker``: the label of this worker's gauges; ``model_name``: the name TorchServe
    serves it under; ``drain_left``: while the server is stopping, the seconds left to answer every
    request."""
    engine = load_engine(settings, model_dir, gpu_id)
    rules = engine.family.rules
    settings = settings.for_model(*engine.family.native_size(), rules)
    sla = settings.metrics.latency_sla_seconds
    service = DiffusionService(
        engine,
        RequestPolicy(settings.limits, settings.defaults, streaming=streaming, model_name=model_name, rules=rules),
        StepProfile(engine, settings.max_images_per_call, settings.defaults.scheduler, settings.step_time_cap),
        DiffusionMetrics(sink, sla, worker),
        sla,
        settings.log_prompts,
        settings.iteration_budget_ms / 1000,
        settings.metrics.synchronize_steps,
        settings.request_timeout_s or math.inf,
        batch_size,
        drain_left=drain_left,
    )
    return service, settings
