"""TorchServe adapter: the only module that knows TorchServe.

It maps TorchServe's batch and context onto ``TextToImageService`` and the service's responses
back onto per-request status, content type and headers.
"""

from __future__ import annotations

import logging
import time
from http import HTTPStatus
from typing import Any

from ts.metrics.metric_cache_errors import MetricsCacheKeyError
from ts.metrics.metric_type_enum import MetricTypes
from ts.torch_handler.base_handler import BaseHandler

from handler.batching import CallKey
from handler.config import HandlerSettings, WarmupShape
from handler.continuous import Chunk, ContinuousService, build_continuous_service
from handler.metrics import MetricSink, MetricSpec
from handler.pipeline import TextToImage, compile_cache_summary
from handler.service import IncomingRequest, Response, build_service

logger = logging.getLogger(__name__)

BODY_KEYS = ("body", "data")


def _content_type(context: Any, index: int, body_key: str | None) -> str | None:
    """The Content-Type of the body part, else of the HTTP request."""
    if body_key is not None:
        part = context.get_request_header(index, body_key)
        if isinstance(part, dict) and part.get("content-type"):
            return part["content-type"]
    headers = context.get_all_request_header(index)
    return next((value for name, value in headers.items() if name.lower() == "content-type" and isinstance(value, str)), None)


def to_incoming(row: dict[str, Any], context: Any, index: int) -> IncomingRequest:
    """One TorchServe request row -> ``IncomingRequest``: the raw body, or the form/query fields."""
    body_key = next((key for key in BODY_KEYS if key in row), None)
    fields = {name: value for name, value in row.items() if name not in BODY_KEYS}
    body = row.get(body_key) if body_key else None
    return IncomingRequest(body=body, content_type=_content_type(context, index, body_key), fields=fields)


def _warmup_keys(settings: HandlerSettings) -> list[tuple[WarmupShape, CallKey]]:
    """The configured warm-up shapes (by default the default size, one image) as pipeline keys."""
    defaults = settings.defaults
    shapes = settings.warmup or (WarmupShape(width=defaults.width, height=defaults.height),)
    return [
        (shape, CallKey(shape.width, shape.height, shape.num_inference_steps, defaults.scheduler, defaults.guidance_scale))
        for shape in shapes
    ]


def _stopping_criterion(chunk: Chunk):
    done = None if chunk.final and chunk.first else chunk.final
    return lambda _response: done


def torchserve_metric_sink(cache: Any, model_name: str) -> MetricSink:
    """Record into TorchServe's metrics cache (the metrics declared in the ``metrics_config`` file).
    A function, not a class: TorchServe wants exactly one class in the handler module."""
    undeclared: set[str] = set()

    def record(spec: MetricSpec, value: float, labels: tuple[str, ...]) -> None:
        try:
            metric = cache.get_metric(spec.name, MetricTypes[spec.type.upper()])
        except MetricsCacheKeyError:
            if spec.name not in undeclared:
                undeclared.add(spec.name)
                logger.warning("metric %s is not declared in the metrics_config file; not recorded", spec.name)
            return
        metric.add_or_update(value, [model_name, *labels])

    return record


class StableDiffusionHandler(BaseHandler):
    """Text-to-image with a diffusers Stable Diffusion pipeline: request-level batching, or
    step-level continuous batching with ``continuousBatching: true`` in model-config.yaml."""

    def initialize(self, context: Any) -> None:
        started = time.perf_counter()
        properties = context.system_properties
        self.manifest = context.manifest
        model_yaml = getattr(context, "model_yaml_config", None) or {}
        settings = HandlerSettings.from_model_yaml(model_yaml)
        sink = torchserve_metric_sink(context.metrics, context.model_name)
        self.continuous = bool(model_yaml.get("continuousBatching"))
        build = build_continuous_service if self.continuous else build_service
        self.service, settings = build(settings, properties["model_dir"], sink, properties.get("gpu_id"))
        engine = self.service.stepper.engine if self.continuous else self.service.engine
        loaded = time.perf_counter()
        warmup_seconds = self._warm_up(engine, settings)
        if self.continuous:
            warmup_seconds += self._profile_steps(self.service, settings)
        self.service.metrics.worker_ready(time.perf_counter() - started)
        self.initialized = True
        if settings.compile.enabled:
            logger.info("compile cache: %s", compile_cache_summary())
        logger.info(
            "stable-diffusion worker ready: %s defaults=%s limits=%s load_s=%.2f warmup_s=%.2f",
            engine.description,
            settings.defaults.model_dump(),
            settings.limits.model_dump(),
            loaded - started,
            warmup_seconds,
        )

    @staticmethod
    def _warm_up(engine: TextToImage, settings: HandlerSettings) -> float:
        """Generate each configured warm-up shape (by default the default size, one image)."""
        return sum(engine.warm_up(key, shape.batch_size) for shape, key in _warmup_keys(settings))

    @staticmethod
    def _profile_steps(service: ContinuousService, settings: HandlerSettings) -> float:
        """Measure the step-time profile (the batch cap) at each warm-up shape."""
        started = time.perf_counter()
        for _, key in _warmup_keys(settings):
            service.profile.measure(key)
        return time.perf_counter() - started

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[bytes]:
        self.context = context
        if self.continuous:
            return self._iterate(data, context)
        batch = [to_incoming(row, context, index) for index, row in enumerate(data)]
        responses = self.service.handle_batch(batch)
        for index, response in enumerate(responses):
            self._set_response_meta(context, index, response)
        return [response.body for response in responses]

    def _iterate(self, data: list[dict[str, Any]], context: Any) -> list[bytes]:
        """One continuous-batching iteration: new requests bring their rows, running ones an
        empty row. A request's stopping criterion is whether its chunk is final; None for a
        request answered in its first iteration, so it gets an ordinary (not chunked) response."""
        ids = [context.request_ids[index] for index in range(len(data))]
        new = {
            rid: to_incoming(row, context, index)
            for index, (rid, row) in enumerate(zip(ids, data))
            if rid not in self.service.flights
        }
        chunks = self.service.iterate(new, ids)
        for index, rid in enumerate(ids):
            self._set_response_meta(context, index, chunks[rid])
        context.stopping_criteria = [_stopping_criterion(chunks[rid]) for rid in ids]
        return [chunks[rid].body for rid in ids]

    @staticmethod
    def _set_response_meta(context: Any, index: int, response: Response | Chunk) -> None:
        context.set_response_status(response.status, HTTPStatus(response.status).phrase, index)
        context.set_response_content_type(index, response.content_type)
        for name, value in response.headers.items():
            context.set_response_header(index, name, value)

