"""The request protocol, one for both batching modes: what comes in, what goes out.

``IncomingRequest`` is a request as the server hands it over; ``decode`` turns it into a validated
``GenerationRequest`` or a ``RequestError``. ``Response`` is what one request gets from one handler
call: its final answer, or with continuous batching a chunk of it (TorchServe sends the status,
content type and headers of a request's first chunk).

``Api`` is the hook contract of a wire API over the one engine: how a request is read and how its
answer, progress and errors are written. ``NATIVE`` is this server's own JSON API (and gRPC);
``handler.api.openai_images`` is the OpenAI Images API; ``handler.api.routes`` picks one by URL path.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from PIL.Image import Image

from handler.api.bodies import decode_body, decode_form
from handler.api.encode import CONTENT_TYPES, JSON_CONTENT_TYPE, encode_image, error_json, images_json, json_body
from handler.api.errors import RequestError
from handler.api.policy import RequestPolicy
from handler.api.request import FIELD_LABELS, GenerationRequest

SEED_HEADER = "X-Seed"
# "true" when the safety checker flagged the (one) image of an image response, "false" when it
# passed it; absent when no checker ran, and with continuous batching unless the answer is one
# chunk (TorchServe sends headers with the first chunk). The image's EXIF says it in every case.
NSFW_HEADER = "X-NSFW-Content-Detected"
STREAM_CONTENT_TYPE = "application/x-ndjson"


@dataclass(frozen=True)
class IncomingRequest:
    """One request as the server hands it over: the body (pre-decoded or raw), its Content-Type,
    any form or query fields, whether it came over gRPC, and the URL path after the model's
    version (TorchServe's ``url_path``; empty for ``/predictions/{model}``)."""

    body: Any
    content_type: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    over_grpc: bool = False
    path: str = ""


@dataclass(frozen=True)
class Response:
    """A request's answer from one handler call. ``final``: its last part; ``first``: its first
    (whose status, content type and headers reach the client)."""

    status: int
    body: bytes
    content_type: str
    headers: dict[str, str] = field(default_factory=dict)
    final: bool = True
    first: bool = True


def decode(incoming: IncomingRequest, policy: RequestPolicy) -> GenerationRequest:
    """Validate one request, with a concrete seed. Raises ``RequestError``."""
    if incoming.over_grpc:
        policy = replace(policy, over_grpc=True)
    has_body = not without_body(incoming)
    if incoming.fields and has_body:
        names = ", ".join(sorted(incoming.fields))
        raise RequestError.single(
            "body",
            "one_source",
            f"send fields either in the body or as form/query fields, not both (got fields {names})",
        )
    if incoming.fields:
        return decode_form(incoming.fields, policy).with_seed()
    return decode_body(incoming.body if has_body else bytearray(), incoming.content_type, policy).with_seed()


def without_body(incoming: IncomingRequest) -> bool:
    """Whether a request carries no body (None, or empty raw bytes)."""
    return incoming.body is None or isinstance(incoming.body, (bytes, bytearray)) and not incoming.body


def bad_request(error: RequestError) -> Response:
    details = [item.as_dict() for item in error.errors]
    return Response(400, error_json(400, "InvalidRequest", str(error), details), JSON_CONTENT_TYPE)


def does_not_fit(request: GenerationRequest) -> Response:
    message = (
        f"out of memory generating {request.num_images_per_prompt} image(s) of {request.width}x{request.height} "
        "even alone; ask for fewer images or fewer pixels"
    )
    return Response(507, error_json(507, "OutOfMemory", message), JSON_CONTENT_TYPE)


def deadline_exceeded(steps_done: int, total_steps: int, timeout_seconds: float) -> Response:
    """504: the request would pass its time limit in the worker before it finishes."""
    message = (
        f"the request was cancelled after {steps_done} of {total_steps} steps: it would not finish "
        f"within the worker's time limit of {timeout_seconds:g} s (handler.request_timeout_s); ask for fewer steps, "
        "images or pixels"
    )
    return Response(504, error_json(504, "DeadlineExceeded", message), JSON_CONTENT_TYPE)


# Seconds a client refused by a stopping server waits before it retries (a load balancer sends the
# retry to a replica that is ready).
RETRY_AFTER_S = 1


def shutting_down(progress: tuple[int, int] | None = None) -> Response:
    """503 with ``Retry-After``: the server is stopping. Without ``progress`` (steps done, total
    steps) the request was not admitted; with it, it was cancelled because the server's grace
    period ends before it would finish."""
    if progress is None:
        message = "the server is stopping and takes no new requests; retry (another replica serves it)"
    else:
        message = (
            f"the request was cancelled after {progress[0]} of {progress[1]} steps: the server is stopping and its "
            "grace period ends before the request would finish; retry (the same seed gives the same image)"
        )
    headers = {"Retry-After": str(RETRY_AFTER_S)}
    return Response(503, error_json(503, "ShuttingDown", message), JSON_CONTENT_TYPE, headers)


def busy(message: str) -> Response:
    """503 with ``Retry-After``: what the request needs is held by requests in flight."""
    headers = {"Retry-After": str(RETRY_AFTER_S)}
    return Response(503, error_json(503, "Busy", message), JSON_CONTENT_TYPE, headers)


def internal_error(stage: str, error: Exception) -> Response:
    """500 (507 for out of memory) naming the stage that failed."""
    if isinstance(error, torch.OutOfMemoryError):
        message = f"the accelerator ran out of memory during {stage}"
        return Response(507, error_json(507, "OutOfMemory", message), JSON_CONTENT_TYPE)
    message = f"{stage} failed: {type(error).__name__}: {error}"
    return Response(500, error_json(500, "InternalServerError", message), JSON_CONTENT_TYPE)


def content_type(request: GenerationRequest) -> str:
    """The Content-Type of a request's answer: NDJSON when streamed, the image type for one image
    in ``image`` mode, JSON (base64 images) otherwise."""
    if request.stream:
        return STREAM_CONTENT_TYPE
    if request.response_format == "image" and request.num_images_per_prompt == 1:
        return CONTENT_TYPES[request.output_format]
    return JSON_CONTENT_TYPE


def headers(request: GenerationRequest, nsfw_content_detected: list[bool] | None = None) -> dict[str, str]:
    """The seed, always; for one image in ``image`` mode, whether the safety checker flagged it."""
    names = {SEED_HEADER: str(request.seed)}
    if nsfw_content_detected is not None and content_type(request) in CONTENT_TYPES.values():
        names[NSFW_HEADER] = str(nsfw_content_detected[0]).lower()
    return names


def encode_images(request: GenerationRequest, images: list[Image], metadata: dict[str, Any]) -> list[bytes]:
    """The images in the request's format, each carrying its safety flag; ``timings`` gains ``encode_s``."""
    started = time.perf_counter()
    flags = metadata["nsfw_content_detected"] or [None] * len(images)
    encoded = [
        encode_image(image, request.output_format, flag, request.output_compression)
        for image, flag in zip(images, flags, strict=True)
    ]
    metadata["timings"]["encode_s"] = round(time.perf_counter() - started, 6)
    return encoded


def encode_preview(request: GenerationRequest, images: list[Image]) -> list[str]:
    """Preview images in the request's format, base64."""
    metadata: dict[str, Any] = {"nsfw_content_detected": None, "timings": {}}
    return [base64.b64encode(data).decode("ascii") for data in encode_images(request, images, metadata)]


def success(request: GenerationRequest, images: list[Image], metadata: dict[str, Any]) -> Response:
    """Raw image bytes for one image in ``image`` mode, else JSON with base64 images and
    ``metadata`` (``timings`` gains ``encode_s``); a streamed request gets its ``done`` event line."""
    encoded = encode_images(request, images, metadata)
    kind = content_type(request)
    if kind in CONTENT_TYPES.values():
        return Response(200, encoded[0], kind, headers(request, metadata["nsfw_content_detected"]))
    if request.stream:
        body = images_json(encoded, {"event": "done", "format": request.output_format, **metadata}) + b"\n"
    else:
        body = images_json(encoded, metadata)
    return Response(200, body, kind, headers(request))


def stream_event(payload: dict[str, Any]) -> bytes:
    """One NDJSON line of a streamed answer."""
    return json_body(payload) + b"\n"


def as_stream_error(response: Response) -> bytes:
    """An error ``Response`` as the ``{"event": "error", ...}`` line a streaming client reads."""
    return stream_event({"event": "error", **json.loads(response.body)})


# A preview of a job's images decoded from its latents now (the service's VAE call).
Preview = Callable[[], list[Image]]


class Api(Protocol):
    """The hooks of one wire API over the engine. The service calls them for every request it
    admits through this API; none may raise for a request's own reasons."""

    field_labels: frozenset[str]  # field names that metric labels may carry as they are

    def decode(self, incoming: IncomingRequest, policy: RequestPolicy) -> GenerationRequest:
        """A validated request with a concrete seed. Raises ``RequestError`` naming the fields in
        this API's terms."""
        ...

    def content_type(self, request: GenerationRequest) -> str: ...

    def headers(self, request: GenerationRequest) -> dict[str, str]:
        """Headers of a request's first part when it is not the whole answer."""
        ...

    def progress(
        self, request: GenerationRequest, step: int, total_steps: int, elapsed: float, preview: Preview
    ) -> bytes:
        """A streamed request's part after a step (empty for none); ``preview`` decodes its images now."""
        ...

    def success(self, request: GenerationRequest, images: list[Image], metadata: dict[str, Any]) -> Response: ...

    def error(self, response: Response) -> Response:
        """An error ``Response`` (native JSON error body) in this API's error shape."""
        ...

    def stream_error(self, response: Response, first: bool) -> bytes:
        """An error, already in this API's shape, as the last part of a streamed answer (``first``:
        its only part, which carries the error's status)."""
        ...


class NativeApi:
    """This server's own JSON API at ``/predictions/{model}``, and gRPC."""

    field_labels = FIELD_LABELS

    def decode(self, incoming: IncomingRequest, policy: RequestPolicy) -> GenerationRequest:
        return decode(incoming, policy)

    def content_type(self, request: GenerationRequest) -> str:
        return content_type(request)

    def headers(self, request: GenerationRequest) -> dict[str, str]:
        return headers(request)

    def progress(
        self, request: GenerationRequest, step: int, total_steps: int, elapsed: float, preview: Preview
    ) -> bytes:
        """A ``progress`` line after every step; at a preview step it carries the images so far."""
        event: dict[str, Any] = {"event": "progress", "step": step, "total_steps": total_steps}
        event["elapsed_s"] = round(elapsed, 6)
        if step in request.preview_steps(total_steps):
            event["images"] = encode_preview(request, preview())
        return stream_event(event)

    def success(self, request: GenerationRequest, images: list[Image], metadata: dict[str, Any]) -> Response:
        return success(request, images, metadata)

    def error(self, response: Response) -> Response:
        return response

    def stream_error(self, response: Response, first: bool) -> bytes:
        """An ``error`` line, also as the only part."""
        return as_stream_error(response)


NATIVE = NativeApi()
