"""TorchServe adapter: the only module that knows TorchServe.

It maps TorchServe's batch and context onto ``DiffusionService`` (one loop per batching mode,
picked once at ``initialize``) and the service's responses back onto per-request status, content
type, headers and, with continuous batching, stopping criteria.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from ts.metrics.metric_cache_errors import MetricsCacheKeyError
from ts.metrics.metric_type_enum import MetricTypes
from ts.torch_handler.base_handler import BaseHandler

from handler import single_worker
from handler.api.encode import JSON_CONTENT_TYPE, json_body
from handler.api.protocol import IncomingRequest, Response
from handler.config import HandlerSettings, continuous_batching
from handler.control import Control
from handler.engine.loading import compile_cache_summary
from handler.metrics import MetricSink, MetricSpec
from handler.service.loops import build_service

logger = logging.getLogger(__name__)

BODY_KEYS = ("body", "data")
# TorchServe 0.12's gRPC StreamPredictions reads this header of every answer and, where it is
# missing, fails the worker (NullPointerException in GRPCJob.response); "false" ends the call.
STREAM_NEXT_HEADER = "ts_stream_next"
# Where TorchServe puts the path segments after /predictions/{model}/{version}/.
URL_PATH_HEADER = "url_path"
# TorchServe's mark of a describe call (GET /models/NAME?customized=true): "True". It reaches a worker
# as a request of its own, never batched with others under dynamic batching. TorchServe also passes
# a prediction's HTTP headers on, so a request's own "describe" header must not make it one.
DESCRIBE_HEADER = "describe"


def _content_type(context: Any, index: int, body_key: str | None) -> str | None:
    """The Content-Type of the body part, else of the HTTP request."""
    if body_key is not None:
        part = context.get_request_header(index, body_key)
        if isinstance(part, dict) and part.get("content-type"):
            return part["content-type"]
    headers = context.get_all_request_header(index)
    return next(
        (value for name, value in headers.items() if name.lower() == "content-type" and isinstance(value, str)), None
    )


def _over_grpc(context: Any, index: int) -> bool:
    """Whether a new request came over gRPC: its headers are only per-input entries (dicts), while an
    HTTP request's include its HTTP headers (strings). Meaningless for a request in flight under
    continuous batching (TorchServe sends its later rows without headers)."""
    return not any(isinstance(value, str) for value in context.get_all_request_header(index).values())


def _url_path(context: Any, index: int) -> str:
    """The URL path after ``/predictions/{model}/{version}/`` (TorchServe's ``url_path`` header;
    empty for ``/predictions/{model}`` and gRPC)."""
    path = context.get_request_header(index, URL_PATH_HEADER)
    return path if isinstance(path, str) else ""


def to_incoming(row: dict[str, Any], context: Any, index: int) -> IncomingRequest:
    """One TorchServe request row -> ``IncomingRequest``: the raw body, or the form/query fields."""
    body_key = next((key for key in BODY_KEYS if key in row), None)
    fields = {name: value for name, value in row.items() if name not in BODY_KEYS}
    body = row.get(body_key) if body_key else None
    return IncomingRequest(
        body=body,
        content_type=_content_type(context, index, body_key),
        fields=fields,
        over_grpc=_over_grpc(context, index),
        path=_url_path(context, index),
    )


def _is_describe_call(data: list[dict[str, Any]], context: Any) -> bool:
    """Whether this call is TorchServe's describe call: alone, bodiless, marked."""
    return (
        len(data) == 1
        and not any(data[0].get(key) for key in BODY_KEYS)
        and context.get_request_header(0, DESCRIBE_HEADER) == "True"
    )


def _stopping_criterion(response: Response) -> Callable[[Any], bool | None]:
    """Whether TorchServe should stop streaming this request: its final part ends it, and None
    for an answer in one part (TorchServe then sends an ordinary, unchunked response)."""
    done = None if response.final and response.first else response.final
    return lambda _response: done


def worker_id(argv: list[str]) -> str:
    """The worker's id as TorchServe's describe API shows it: the port its frontend connection is
    named after (``--sock-name <tmp>/.ts.sock.9000``, or ``--port 9000``); else the process id."""
    for flag in ("--sock-name", "--port"):
        if flag in argv[:-1]:
            return argv[argv.index(flag) + 1].rsplit(".", 1)[-1]
    return str(os.getpid())


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
    """Text-to-image with a diffusers Stable Diffusion pipeline on the step engine, under
    TorchServe's dynamic batching or, with ``continuousBatching: true``, its continuous batching."""

    _single_worker_lock: int | None = None  # held for the process's life with continuous batching

    def initialize(self, context: Any) -> None:
        started = time.perf_counter()
        properties = context.system_properties
        self.manifest = context.manifest
        model_yaml = getattr(context, "model_yaml_config", None) or {}
        settings = HandlerSettings.from_model_yaml(model_yaml)
        continuous = continuous_batching(model_yaml)
        worker = worker_id(sys.argv)
        self.control = Control.from_environment(worker)
        if continuous:  # before anything slow: a refused second worker costs TorchServe's retries little
            self._single_worker_lock = single_worker.claim(properties["model_dir"], context.model_name)
        self.service, settings = build_service(
            settings,
            properties["model_dir"],
            torchserve_metric_sink(context.metrics, context.model_name),
            properties.get("gpu_id"),
            streaming=continuous,
            batch_size=properties.get("batch_size"),
            worker=worker,
            model_name=context.model_name,
            drain_left=self.control.drain_seconds_left,
        )
        self.continuous = continuous
        self._loop = self.service.iterate if continuous else self.service.run_batch
        self._longest_park_s = settings.request_timeout_s or 0.0
        loaded = time.perf_counter()
        warmup_seconds = self.service.warm_up(settings.warmup_shapes())
        self.service.metrics.worker_ready(time.perf_counter() - started)
        self.initialized = True
        if settings.compile.enabled and settings.compile.backend == "inductor":  # the only one that caches code
            logger.info("compile cache: %s", compile_cache_summary())
        logger.info(
            "stable-diffusion worker %s ready: %s batching=%s batch_size=%s request_timeout_s=%g defaults=%s limits=%s "
            "load_s=%.2f warmup_s=%.2f",
            self.service.metrics.worker,
            self.service.engine.description,
            "continuous" if continuous else "dynamic",
            properties.get("batch_size"),
            settings.request_timeout_s,
            settings.defaults.model_dump(),
            settings.limits.model_dump(),
            loaded - started,
            warmup_seconds,
        )

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[bytes]:
        """One batch (dynamic batching) or iteration (continuous batching): every request's answer,
        or its part; a describe call gets ``_describe``'s."""
        self.context = context
        ids = [context.request_ids[index] for index in range(len(data))]
        if _is_describe_call(data, context):  # a call of its own
            requests, responses = {}, {ids[0]: self._describe()}
        else:
            requests = {
                rid: to_incoming(row, context, index) for index, (rid, row) in enumerate(zip(ids, data, strict=True))
            }
            responses = self._loop(requests)
        if self.continuous:  # whether each part is its request's last
            context.stopping_criteria = [_stopping_criterion(responses[rid]) for rid in ids]
        for index, rid in enumerate(ids):
            over_grpc = rid in requests and requests[rid].over_grpc
            self._set_response_meta(context, index, responses[rid], over_grpc)
        return [responses[rid].body for rid in ids]

    def _describe(self) -> Response:
        """This worker's state for ``GET /models/NAME?customized=true``. A worker that the server is
        removing (``python -m server.cli scale``) parks in the call first, so that it has no request
        in flight when TorchServe shuts it down (``handler.control``)."""
        parked_s = self.control.park(self._longest_park_s) if self.control.retiring() else 0.0
        state = {
            "worker": self.control.worker,
            "batching": "continuous" if self.continuous else "dynamic",
            "parked_s": round(parked_s, 3),
        }
        return Response(200, json_body(state), JSON_CONTENT_TYPE)

    @staticmethod
    def _set_response_meta(context: Any, index: int, response: Response, over_grpc: bool) -> None:
        context.set_response_status(response.status, HTTPStatus(response.status).phrase, index)
        context.set_response_content_type(index, response.content_type)
        for name, value in response.headers.items():
            context.set_response_header(index, name, value)
        if response.final and response.first and over_grpc:
            context.set_response_header(index, STREAM_NEXT_HEADER, "false")
