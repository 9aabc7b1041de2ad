"""Admission: requests become jobs of the step engine. Each is routed to its API, decoded and
validated, given its LoRAs and ControlNets and checked against the memory its shape needs; then
the requests admitted together start in one text-encoder call. Everything that can fail for a
request's own reasons fails here, with its own status."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

from handler.adapters.library import Busy, EntryError
from handler.adapters.lora_rows import Adapters
from handler.api.errors import RequestError
from handler.api.policy import RequestPolicy
from handler.api.protocol import (
    Api,
    IncomingRequest,
    Response,
    bad_request,
    busy,
    does_not_fit,
    internal_error,
    shutting_down,
)
from handler.api.request import GenerationRequest
from handler.api.routes import route
from handler.engine.jobs import PROMPT_FIELDS, DenoiseJob, JobSpec
from handler.engine.loading import release_cached_memory
from handler.engine.scheduling import StepProfile
from handler.engine.step_engine import StepEngine
from handler.metrics import DiffusionMetrics
from handler.service.flights import Flight, Flights, job_spec

logger = logging.getLogger(__name__)
MIB = 2**20

Acquired = TypeVar("Acquired")


class Admission:
    """Admits new requests into ``flights``; those that cannot start get their answer at once."""

    def __init__(
        self,
        engine: StepEngine,
        policy: RequestPolicy,
        profile: StepProfile,
        metrics: DiffusionMetrics,
        flights: Flights,
        clock: Callable[[], float],
        latency_sla_seconds: float,
        request_timeout_seconds: float,
        log_prompts: bool,
        drain_left: Callable[[], float | None],
    ):
        self.engine = engine
        self.policy = policy
        self.profile = profile
        self.metrics = metrics
        self.flights = flights
        self.clock = clock
        self.sla = latency_sla_seconds
        self.request_timeout = request_timeout_seconds
        self.log_prompts = log_prompts
        self.drain_left = drain_left
        self.kept_budget = kept_budget(policy.cache.max_kept_mib, engine.device)

    def admit(self, new: dict[str, IncomingRequest]) -> dict[str, Response]:
        """Decode, validate and start new requests together; those that cannot start get their answer now."""
        if not new:
            return {}
        self.metrics.batch_received(len(new))
        # Counted in the worker from now on: a stopping server waits for them (server.process.drain).
        self.metrics.queue(self.flights.gauges(requests=len(self.flights) + len(new)))
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

    def _extensions(self) -> dict[str, list[dict[str, Any]]]:
        """The LoRAs and ControlNets a request may name now, and the embeddings a prompt may say."""
        embeddings = self.engine.embeddings.available() if self.engine.embeddings is not None else []
        return {
            "loras": [entry.describe() for entry in self.engine.loras.available()],
            "controlnets": [entry.describe() for entry in self.engine.controlnets.available()],
            "embeddings": [entry.describe() for entry in embeddings],
        }

    def _start(self, requests: dict[str, GenerationRequest]) -> dict[str, DenoiseJob | Response]:
        """Jobs for the requests, started together; 400 for a LoRA or ControlNet that cannot be
        served, 503 where loading one needs what is held now, 507 for a request whose shape and
        image count already ran out of memory alone (a shape seen for the first time is profiled first)."""
        outcomes: dict[str, DenoiseJob | Response] = {}
        specs: dict[str, JobSpec] = {}
        starting_tokens: set[str] = set()  # the embeddings of the requests starting together
        for rid, request in requests.items():
            refused = self._cache_room(rid, request, specs.values())  # before anything is loaded or profiled
            if refused is not None:
                outcomes[rid] = refused
                continue
            adapters = self._adapters(rid, request, specs.values())
            if isinstance(adapters, Response):
                outcomes[rid] = adapters
                continue
            nets = self._controlnets(rid, request, specs.values())
            if isinstance(nets, Response):
                outcomes[rid] = nets
                continue
            tokens = self._embeddings(rid, request, starting_tokens)
            if isinstance(tokens, Response):
                outcomes[rid] = tokens
                continue
            spec = job_spec(request, adapters, nets, tokens)
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

    def _adapters(self, rid: str, request: GenerationRequest, starting: Iterable[JobSpec]) -> Adapters | Response:
        """The request's LoRA adapters, loaded where needed (keeping those of the jobs in flight and
        starting), or its answer."""
        if not request.loras:
            return ()
        loras = self.engine.loras
        in_use = {adapter for spec in self.flights.specs_in_use(starting) for adapter, _ in spec.adapters}
        adapters = self._acquire(
            rid,
            "loras",
            lambda: loras.acquire([(lora.name, lora.scale) for lora in request.loras], in_use),
            lambda: self.metrics.loras_loaded(loras.loaded),
        )
        if not isinstance(adapters, Response):
            self.metrics.lora_requests([lora.name for lora in request.loras])
        return adapters

    def _controlnets(
        self, rid: str, request: GenerationRequest, starting: Iterable[JobSpec]
    ) -> tuple[str, ...] | Response:
        """The ids of the request's ControlNets, loaded where needed (keeping those of the jobs in
        flight and starting), or its answer."""
        if not request.controlnets:
            return ()
        nets = self.engine.controlnets
        in_use = {control.net for spec in self.flights.specs_in_use(starting) for control in spec.controls}
        names = [choice.name for choice in request.controlnets]
        ids = self._acquire(
            rid,
            "controlnets",
            lambda: tuple(nets.acquire(names, in_use)),
            lambda: self.metrics.controlnets_loaded(nets.loaded),
        )
        if not isinstance(ids, Response):
            self.metrics.controlnet_requests(names)
        return ids

    def _embeddings(self, rid: str, request: GenerationRequest, starting: set[str]) -> dict[str, str] | Response:
        """The tokens of the embeddings the request's prompts and negative prompts name (name ->
        token), loaded where needed, keeping those of the requests ``starting`` with it (their text
        encoders have not run yet), or its answer: 400 naming the field whose text named one that
        cannot be served."""
        library = self.engine.embeddings
        tokens: dict[str, str] = {}
        if library is None:
            return tokens
        named = library.named_in(*(getattr(request, field) for field in PROMPT_FIELDS))
        for field, said in zip(PROMPT_FIELDS, named, strict=True):
            names = [name for name in said if name not in tokens]
            if not names:
                continue
            keep = starting | set(tokens.values())
            acquired = self._acquire(rid, field, functools.partial(library.acquire, names, keep), lambda: None)
            if isinstance(acquired, Response):
                return acquired
            tokens |= acquired
        starting.update(tokens.values())
        return tokens

    def _acquire(
        self, rid: str, field: str, acquire: Callable[[], Acquired], count_loaded: Callable[[], None]
    ) -> Acquired | Response:
        """What a library's ``acquire`` gives, or the request's answer: 400 naming ``field`` for an
        entry that cannot be served, 503 with ``Retry-After`` where loading needs what is held now."""
        try:
            return acquire()
        except EntryError as error:
            logger.info("request %s rejected: %s (%s)", rid, field, error.rule)
            self.metrics.request_rejected([field])
            return bad_request(RequestError.single(field, error.rule, str(error)))
        except Busy as error:
            logger.info("request %s refused: %s", rid, error)
            return busy(str(error))
        finally:
            count_loaded()

    def _fits(self, spec: JobSpec) -> bool:
        """False when a job of its shape and cost (rows, with its ControlNets) already ran out of memory alone."""
        shape = self.engine.latent_shape(spec.width, spec.height)
        if not self.profile.measured(shape):
            self.profile.measure(spec.width, spec.height)
        return self.profile.fits_job(spec)

    def _cache_room(self, rid: str, request: GenerationRequest, starting: Iterable[JobSpec]) -> Response | None:
        """None where the step cache of the request fits beside those of the jobs in flight and
        starting (``handler.cache.max_kept_mib``); else 503 with ``Retry-After``, or 400 naming
        ``cache`` for a cache over the bound alone."""
        budget = self.kept_budget
        if budget is None:
            return None
        kept = self.engine.kept_bytes(job_spec(request))
        if not kept:
            return None
        held = sum(self.engine.kept_bytes(other) for other in self.flights.specs_in_use(starting))
        if held + kept <= budget:
            return None
        if kept > budget:
            logger.info("request %s rejected: its cache keeps %.1f MiB", rid, kept / MIB)
            self.metrics.request_rejected(["cache"])
            message = (
                f"this cache keeps {kept / MIB:.1f} MiB for {request.num_images_per_prompt} image(s) of "
                f"{request.width}x{request.height}, over handler.cache.max_kept_mib ({budget / MIB:g} MiB); "
                'send fewer images or {"mode": "off"} (a request without cache takes handler.cache.default)'
            )
            return bad_request(RequestError.single("cache", "cache_memory", message))
        logger.info("request %s refused: caches in flight keep %.1f MiB", rid, held / MIB)
        return busy(
            f"the step caches of the requests in flight keep {held / MIB:.1f} MiB of handler.cache.max_kept_mib "
            f"({budget / MIB:g} MiB), this one would keep {kept / MIB:.1f} MiB; retry when they finish"
        )

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


def kept_budget(max_kept_mib: float | None, device: torch.device) -> int | None:
    """Bytes the step caches of the requests in flight may keep together: ``max_kept_mib``, else a
    quarter of a CUDA device's memory; None (no bound) on the CPU."""
    if max_kept_mib is not None:
        return int(max_kept_mib * MIB)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // 4
    return None
