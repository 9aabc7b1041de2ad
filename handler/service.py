"""Server-independent request flow for one batch: decode -> group -> generate -> encode.

Every request of a batch gets exactly one ``Response``; a bad or failing request never fails
its batchmates. What happens is recorded through ``DiffusionMetrics``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL.Image import Image

from handler.batching import CallInputs, PipelineCall, group_requests
from handler.encode import CONTENT_TYPES, JSON_CONTENT_TYPE, encode_image, error_json, images_json
from handler.config import HandlerSettings
from handler.metrics import DiffusionMetrics, MetricSink
from handler.pipeline import TextToImage, load_text_to_image, native_size
from handler.request import GenerationRequest, RequestError, RequestPolicy, decode_body, decode_form

logger = logging.getLogger(__name__)

SEED_HEADER = "X-Seed"


@dataclass(frozen=True)
class IncomingRequest:
    """One request as the server hands it over: the body (pre-decoded or raw), its Content-Type,
    and any form or query fields."""

    body: Any
    content_type: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    content_type: str
    headers: dict[str, str] = field(default_factory=dict)


def decode(incoming: IncomingRequest, policy: RequestPolicy) -> GenerationRequest:
    """Validate one request, with a concrete seed. Raises ``RequestError``."""
    has_body = not (incoming.body is None or isinstance(incoming.body, (bytes, bytearray)) and not incoming.body)
    if incoming.fields and has_body:
        names = ", ".join(sorted(incoming.fields))
        raise RequestError.single(
            "body", "one_source", f"send fields either in the body or as form/query fields, not both (got fields {names})"
        )
    if incoming.fields:
        return decode_form(incoming.fields, policy).with_seed()
    return decode_body(incoming.body if has_body else bytearray(), incoming.content_type, policy).with_seed()


def bad_request(error: RequestError) -> Response:
    details = [item.as_dict() for item in error.errors]
    return Response(400, error_json(400, "InvalidRequest", str(error), details), JSON_CONTENT_TYPE)


def does_not_fit(request: GenerationRequest) -> Response:
    message = (
        f"out of memory generating {request.num_images_per_prompt} image(s) of {request.width}x{request.height} "
        "even alone; ask for fewer images or fewer pixels"
    )
    return Response(507, error_json(507, "OutOfMemory", message), JSON_CONTENT_TYPE)


def internal_error(stage: str, error: Exception) -> Response:
    """500 (507 for out of memory) naming the stage that failed."""
    if isinstance(error, torch.OutOfMemoryError):
        message = f"the accelerator ran out of memory during {stage}"
        return Response(507, error_json(507, "OutOfMemory", message), JSON_CONTENT_TYPE)
    message = f"{stage} failed: {type(error).__name__}: {error}"
    return Response(500, error_json(500, "InternalServerError", message), JSON_CONTENT_TYPE)


def success_content_type(request: GenerationRequest) -> str:
    """The Content-Type of a request's images: the image type for one image in ``image`` mode,
    JSON (base64 images) otherwise."""
    if request.response_format == "image" and request.num_images_per_prompt == 1:
        return CONTENT_TYPES[request.output_format]
    return JSON_CONTENT_TYPE


def encode_response(request: GenerationRequest, images: list[Image], metadata: dict[str, Any]) -> Response:
    """Raw image bytes for one image in ``image`` mode, JSON with base64 images otherwise.
    ``metadata["timings"]`` gains ``encode_s``."""
    started = time.perf_counter()
    encoded = [encode_image(image, request.output_format) for image in images]
    headers = {SEED_HEADER: str(request.seed)}
    content_type = success_content_type(request)
    if content_type != JSON_CONTENT_TYPE:
        return Response(200, encoded[0], content_type, headers)
    metadata["timings"]["encode_s"] = round(time.perf_counter() - started, 6)
    return Response(200, images_json(encoded, metadata), JSON_CONTENT_TYPE, headers)


@dataclass(frozen=True)
class _Batch:
    """What every request of one batch shares, for timings and reporting."""

    started: float
    size: int
    decode_seconds: float


class TextToImageService:
    """Serves batches of text-to-image requests with one loaded pipeline."""

    def __init__(
        self, engine: TextToImage, policy: RequestPolicy, max_images_per_call: int, metrics: DiffusionMetrics,
        log_prompts: bool = False,
    ):
        self.engine = engine
        self.policy = policy
        self.max_images_per_call = max_images_per_call
        self.metrics = metrics
        self.log_prompts = log_prompts

    def handle_batch(self, batch: list[IncomingRequest]) -> list[Response]:
        started = time.perf_counter()
        self.metrics.batch_received(len(batch))
        responses: dict[int, Response] = {}
        requests: dict[int, GenerationRequest] = {}
        for index, incoming in enumerate(batch):
            try:
                requests[index] = decode(incoming, self.policy)
            except RequestError as error:
                rules = ", ".join(f"{item.field} ({item.rule})" for item in error.errors)
                logger.info("request %d of %d rejected: %s", index, len(batch), rules)
                self.metrics.request_rejected([item.field for item in error.errors])
                responses[index] = bad_request(error)
            except Exception as error:  # a bug must cost this request only, not its batchmates
                logger.exception("request %d of %d could not be decoded", index, len(batch))
                responses[index] = internal_error("decoding", error)
        if self.log_prompts:
            for index, request in requests.items():
                logger.info("request %d of %d: %s", index, len(batch), request.parameters())
        context = _Batch(started, len(batch), time.perf_counter() - started)
        for call in group_requests(requests, self.max_images_per_call):
            responses.update(self._run_call(call, requests, context))
        return [responses[index] for index in range(len(batch))]

    def _run_call(self, call: PipelineCall, requests: dict[int, GenerationRequest], batch: _Batch) -> dict[int, Response]:
        """Generate one call and encode its requests. Out of memory splits the call in two and
        retries each half, down to single requests; only a request that cannot fit alone fails."""
        inputs = CallInputs.of(call, requests)
        call_started = time.perf_counter()
        try:
            images, timings = self.engine.generate(call.key, inputs)
        except torch.OutOfMemoryError as error:
            if len(call.members) == 1:
                logger.error("request %d does not fit in memory even alone: %s", call.members[0], error)
                return {call.members[0]: does_not_fit(requests[call.members[0]])}
            logger.warning("out of memory for requests %s; retrying in two halves", list(call.members))
            self.metrics.out_of_memory_retry()
            release_cached_memory()
            responses = {}
            for half in call.halves():
                responses.update(self._run_call(half, requests, batch))
            return responses
        except Exception as error:  # one failing call must not fail the other calls of the batch
            logger.exception("pipeline call for requests %s failed", list(call.members))
            return {index: internal_error("generation", error) for index in call.members}
        inference_seconds = time.perf_counter() - call_started
        self.metrics.pipeline_call(timings, len(images))
        responses = {}
        for index, own_images in inputs.split_by_owner(images).items():
            responses[index] = self._encode(index, requests[index], own_images, batch, len(inputs.seeds), inference_seconds)
        return responses

    def _encode(
        self, index: int, request: GenerationRequest, images: list[Image], batch: _Batch, call_images: int, inference_seconds: float
    ) -> Response:
        metadata = {
            "seed": request.seed,
            "parameters": request.parameters(),
            "batch": {"requests": batch.size, "call_images": call_images},
            "timings": {"decode_s": round(batch.decode_seconds, 6), "inference_s": round(inference_seconds, 6)},
        }
        encode_started = time.perf_counter()
        try:
            response = encode_response(request, images, metadata)
        except Exception as error:
            logger.exception("request %d could not be encoded", index)
            return internal_error("encoding", error)
        finished = time.perf_counter()
        self.metrics.request_completed(finished - batch.started, finished - encode_started)
        return response


def load_engine(
    settings: HandlerSettings, model_dir: str | Path, gpu_id: int | None = None
) -> tuple[TextToImage, HandlerSettings]:
    """Load the pipeline; return it with the settings resolved to the model's native size."""
    engine = load_text_to_image(settings, model_dir, gpu_id)
    return engine, settings.with_native_size(*native_size(engine.pipeline))


def build_service(
    settings: HandlerSettings, model_dir: str | Path, sink: MetricSink, gpu_id: int | None = None
) -> tuple[TextToImageService, HandlerSettings]:
    """Load the pipeline and build the service exactly as a worker does (the handler and the
    benchmarks share this); return it with the settings resolved to the model's native size."""
    engine, settings = load_engine(settings, model_dir, gpu_id)
    service = TextToImageService(
        engine,
        RequestPolicy(settings.limits, settings.defaults),
        settings.max_images_per_call,
        DiffusionMetrics(sink, settings.metrics.latency_sla_seconds),
        settings.log_prompts,
    )
    return service, settings


def release_cached_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
