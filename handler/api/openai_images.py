"""The OpenAI Images API over the step engine: ``v1/images/generations``, ``v1/images/edits`` and
``v1/models``.

TorchServe hands the path after ``/predictions/{model}/{version}/`` to the handler, so the
``openai`` SDK with ``base_url=.../predictions/stable-diffusion/1.0/v1`` calls these routes. Shapes
follow the SDK's types (``ImageGenerateParams``, ``ImagesResponse``, ``ImageGenStreamEvent``,
``Model``): each OpenAI parameter maps onto the native ``GenerationRequest`` (``n`` -> images,
``size`` -> width and height, ``output_format``, ``output_compression``, ``stream``,
``partial_images``), is accepted and ignored where Stable Diffusion has no such knob (``quality``,
``style``, ``moderation``, ``user``, ``model`` naming this model), or is refused naming it
(``response_format: url``, ``background: transparent``, another ``model``). Stable Diffusion's own
parameters come as extra fields (the SDK's ``extra_body``). Edits are image-to-image (and with a
``mask``, inpainting) on the same engine: multipart as the SDK sends them, or JSON with base64
images; ``strength`` comes as an extra field. Errors take OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``, with the native field names mapped back.
"""

from __future__ import annotations

import base64
import json
import re
import time
from dataclasses import replace
from typing import Any, Literal

from PIL.Image import Image
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from handler.api.bodies import form_text, json_fields
from handler.api.encode import JSON_CONTENT_TYPE, json_body
from handler.api.errors import RequestError
from handler.api.policy import RequestPolicy
from handler.api.protocol import (
    SEED_HEADER,
    IncomingRequest,
    Preview,
    Response,
    encode_images,
    encode_preview,
    without_body,
)
from handler.api.request import MAX_PARTIAL_IMAGES, GenerationRequest, validate_fields, validate_model
from handler.config import OutputFormat

GENERATIONS = "v1/images/generations"
EDITS = "v1/images/edits"
MODELS = "v1/models"
SSE_CONTENT_TYPE = "text/event-stream"
# The OpenAI parameter that sets a native field, to name it in errors.
PARAMETER_OF = {"num_images_per_prompt": "n", "width": "size", "height": "size"}
SIZE = re.compile(r"(\d{1,5})x(\d{1,5})")
# The multipart name the SDK gives ``image`` when it is a list (one image is served: the last sent).
LIST_IMAGE_FIELD = "image[]"
# The SDK's types require a usage object on completed events; generation here counts no tokens.
NO_USAGE = {
    "input_tokens": 0,
    "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
    "output_tokens": 0,
    "total_tokens": 0,
}


class StableDiffusionParameters(BaseModel):
    """Stable Diffusion's own parameters in the OpenAI bodies, passed as extra fields (the SDK's
    ``extra_body``) in diffusers' names: every native field that no OpenAI parameter sets, validated
    as the native API validates it."""

    negative_prompt: Any = None
    prompt_2: Any = None
    negative_prompt_2: Any = None
    prompt_3: Any = None
    negative_prompt_3: Any = None
    clip_skip: Any = None
    seed: Any = None
    num_inference_steps: Any = None
    guidance_scale: Any = None
    guidance_rescale: Any = None
    skip_guidance_layers: Any = None
    skip_layer_guidance_scale: Any = None
    skip_layer_guidance_start: Any = None
    skip_layer_guidance_stop: Any = None
    original_size: Any = None
    crops_coords_top_left: Any = None
    target_size: Any = None
    negative_original_size: Any = None
    negative_crops_coords_top_left: Any = None
    negative_target_size: Any = None
    scheduler: Any = None
    timesteps: Any = None
    sigmas: Any = None
    eta: Any = None
    loras: Any = None
    controlnets: Any = None
    cache: Any = None


# Their names, which a request passes on to the native request as they are.
SD_PARAMETERS = tuple(StableDiffusionParameters.model_fields)


class SdkImageParameters(BaseModel):
    """The SDK's ``ImageGenerateParams``, as this server serves them."""

    prompt: Any = Field(description="what to draw (validated as the native prompt)")
    n: int | None = Field(None, description="images to generate (native num_images_per_prompt)")
    size: str | None = Field(None, description="WIDTHxHEIGHT, or auto for the model's native size")
    response_format: Literal["b64_json", "url"] | None = Field(None, description="b64_json only: no image store")
    output_format: OutputFormat | None = None
    output_compression: int | None = Field(None, description="jpeg/webp quality, 0..100")
    quality: Literal["standard", "hd", "low", "medium", "high", "auto"] | None = Field(None, description="ignored")
    style: Literal["vivid", "natural"] | None = Field(None, description="ignored")
    background: Literal["transparent", "opaque", "auto"] | None = Field(None, description="opaque images only")
    moderation: Literal["low", "auto"] | None = Field(None, description="ignored: the model's safety checker runs")
    user: str | None = Field(None, description="ignored")
    model: str | None = Field(None, description="this model's name, or left out")
    stream: bool | None = Field(None, description="server-sent events (continuous batching)")
    partial_images: int | None = Field(None, ge=0, le=MAX_PARTIAL_IMAGES, description="previews while streaming")

    @field_validator("response_format")
    @classmethod
    def _no_urls(cls, value: str | None) -> str | None:
        if value == "url":
            raise PydanticCustomError(
                "url_unavailable",
                "response_format 'url' needs an image store, which this server does not have: images come back "
                "as base64 in b64_json (the default)",
            )
        return value

    @field_validator("background")
    @classmethod
    def _opaque_only(cls, value: str | None) -> str | None:
        if value == "transparent":
            raise PydanticCustomError(
                "transparent_unavailable",
                "Stable Diffusion draws opaque images: background 'transparent' cannot be served; "
                "use 'opaque' or 'auto'",
            )
        return value

    @field_validator("model")
    @classmethod
    def _this_model(cls, value: str | None, info: ValidationInfo) -> str | None:
        served = info.context.model_name if isinstance(info.context, RequestPolicy) else None
        if value is not None and value != served:
            raise PydanticCustomError(
                "model_not_found",
                "model {model!r} is not served here; this endpoint serves {served!r} (name it or leave model out)",
                {"model": value, "served": served},
            )
        return value

    @field_validator("size")
    @classmethod
    def _size_format(cls, value: str | None) -> str | None:
        if value is not None and value != "auto" and not SIZE.fullmatch(value):
            raise PydanticCustomError(
                "size_format", "size should be 'auto' or WIDTHxHEIGHT in pixels, such as '512x512'"
            )
        return value


class ImageGenerationParams(StableDiffusionParameters, SdkImageParameters):
    """The body of ``POST v1/images/generations``: the SDK's ``ImageGenerateParams`` plus Stable
    Diffusion's parameters (validated as the native API validates them), the SDK's first."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def native_fields(self) -> dict[str, Any]:
        """The native request this asks for."""
        fields: dict[str, Any] = {name: getattr(self, name) for name in SD_PARAMETERS if name in self.model_fields_set}
        fields["prompt"] = self.prompt
        if self.n is not None:
            fields["num_images_per_prompt"] = self.n
        if self.size is not None and self.size != "auto":
            width, height = SIZE.fullmatch(self.size).groups()  # type: ignore[union-attr]  # checked above
            fields["width"], fields["height"] = int(width), int(height)
        for name in ("output_format", "output_compression", "partial_images"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.stream:
            fields["stream"] = True
        return fields


class ImageEditParams(ImageGenerationParams):
    """The body of ``POST v1/images/edits``: the SDK's ``ImageEditParams`` (one image) plus Stable
    Diffusion's parameters and ``strength``."""

    image: Any = Field(description="the picture to edit (a file part, or base64 in JSON)")
    mask: Any = Field(None, description="transparent where the image is repainted")
    strength: Any = Field(None, description="the share of the schedule the image goes through")
    input_fidelity: Literal["high", "low"] | None = Field(None, description="ignored")

    @field_validator("image")
    @classmethod
    def _an_image_to_edit(cls, value: Any) -> Any:
        if value is None:
            raise PydanticCustomError("missing", "an edit needs the image to edit")
        return value

    def native_fields(self) -> dict[str, Any]:
        fields = super().native_fields()
        fields["image"] = self.image
        fields.update({name: getattr(self, name) for name in ("mask", "strength") if name in self.model_fields_set})
        return fields


def _request_fields(incoming: IncomingRequest) -> tuple[dict[str, Any], bool]:
    """The body's fields and whether they are typed (JSON: strict) or text (form fields)."""
    if incoming.fields and not without_body(incoming):
        raise RequestError.single("body", "one_source", "send fields either in the body or as form fields, not both")
    if incoming.fields:
        fields = dict(incoming.fields)
        if LIST_IMAGE_FIELD in fields and "image" not in fields:  # the SDK's form name for a list of images
            fields["image"] = fields.pop(LIST_IMAGE_FIELD)
        return form_text(fields), False
    return json_fields(incoming.body if not without_body(incoming) else bytearray()), True


def _openai_names(error: RequestError) -> RequestError:
    """A native validation error with the fields named as the OpenAI parameters that set them."""
    return RequestError([replace(item, field=PARAMETER_OF.get(item.field, item.field)) for item in error.errors])


def error_body(status: int, message: str, param: str | None, code: str | None) -> bytes:
    """OpenAI's error shape."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return json_body({"error": {"message": message, "type": kind, "param": param, "code": code}})


def _sse(event: str, payload: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: ".encode() + json_body(payload) + b"\n\n"


class OpenAIImages:
    """``v1/images/generations`` or ``v1/images/edits``: the OpenAI Images API on the native request."""

    field_labels = frozenset({*ImageEditParams.model_fields, "body"})

    def __init__(self, params: type[ImageGenerationParams], event_prefix: str):
        self.params = params
        self.partial_event = f"{event_prefix}.partial_image"
        self.completed_event = f"{event_prefix}.completed"

    def decode(self, incoming: IncomingRequest, policy: RequestPolicy) -> GenerationRequest:
        fields, strict = _request_fields(incoming)
        params = validate_model(self.params, fields, policy, strict=strict)
        try:
            return validate_fields(params.native_fields(), policy, strict=strict).with_seed()
        except RequestError as error:
            raise _openai_names(error) from None

    def content_type(self, request: GenerationRequest) -> str:
        return SSE_CONTENT_TYPE if request.stream else JSON_CONTENT_TYPE

    def headers(self, request: GenerationRequest) -> dict[str, str]:
        return {SEED_HEADER: str(request.seed)}

    def progress(
        self, request: GenerationRequest, step: int, total_steps: int, elapsed: float, preview: Preview
    ) -> bytes:
        """``*.partial_image`` events (one per image) at the preview steps."""
        steps = request.preview_steps(total_steps)
        if step not in steps:
            return b""
        index = sorted(steps).index(step)
        return b"".join(
            _sse(
                self.partial_event,
                {
                    "type": self.partial_event,
                    **self._image_fields(request, data, image),
                    "partial_image_index": index,
                },
            )
            for image, data in enumerate(encode_preview(request, preview()))
        )

    def success(self, request: GenerationRequest, images: list[Image], metadata: dict[str, Any]) -> Response:
        """``ImagesResponse`` (each image's seed beside it), or with a stream one ``*.completed``
        event per image."""
        encoded = encode_images(request, images, metadata)
        if request.stream:
            body = b"".join(
                _sse(
                    self.completed_event,
                    {
                        "type": self.completed_event,
                        **self._image_fields(request, base64.b64encode(data).decode("ascii"), image),
                        "usage": NO_USAGE,
                    },
                )
                for image, data in enumerate(encoded)
            )
            return Response(200, body, SSE_CONTENT_TYPE, self.headers(request))
        seeds = request.image_seeds()
        flags = metadata["nsfw_content_detected"] or [None] * len(encoded)
        payload = {
            "created": int(time.time()),
            "data": [
                {"b64_json": base64.b64encode(data).decode("ascii"), "seed": seed, "nsfw_content_detected": flag}
                for data, seed, flag in zip(encoded, seeds, flags, strict=True)
            ],
            "background": "opaque",
            "output_format": request.output_format,
            "size": f"{request.width}x{request.height}",
            "parameters": request.parameters(),
            "timings": metadata["timings"],
        }
        return Response(200, json_body(payload), JSON_CONTENT_TYPE, self.headers(request))

    @staticmethod
    def _image_fields(request: GenerationRequest, b64_json: str, image: int) -> dict[str, Any]:
        """What the SDK's stream events carry of one image, with its index and seed."""
        return {
            "b64_json": b64_json,
            "created_at": int(time.time()),
            "size": f"{request.width}x{request.height}",
            "quality": "auto",
            "background": "opaque",
            "output_format": request.output_format,
            "image_index": image,
            "seed": request.image_seeds()[image],
        }

    def error(self, response: Response) -> Response:
        return openai_error(response)

    def stream_error(self, response: Response, first: bool) -> bytes:
        """An ``error`` event, which the SDK raises as ``APIError``; the plain error body when it
        is the only part (its status reaches the client, and the SDK raises by status)."""
        return response.body if first else b"event: error\ndata: " + response.body + b"\n\n"


def openai_error(response: Response) -> Response:
    """A native JSON error in OpenAI's shape: every broken field in the message, the first as
    ``param`` and its rule as ``code`` (else the error's kind)."""
    payload = json.loads(response.body)
    errors = payload.get("errors") or []
    if errors:
        message = "; ".join(f"{item['field']}: {item['message']}" for item in errors)
        param = None if errors[0]["field"] == "body" else errors[0]["field"]
        body = error_body(response.status, message, param, errors[0]["rule"])
    else:
        body = error_body(response.status, payload["message"], None, payload["type"])
    return Response(response.status, body, JSON_CONTENT_TYPE, response.headers)


# When this worker started: the ``created`` of the model it lists.
STARTED = int(time.time())


def models(path: str, model_name: str, extensions: dict[str, list[dict[str, Any]]]) -> Response:
    """``v1/models`` and ``v1/models/{id}``: this model, so that clients which check it work, with
    the LoRAs and ControlNets a request may name (``extensions``: each by name, size, modification time)."""
    model = {"id": model_name, "object": "model", "created": STARTED, "owned_by": "torchserve", **extensions}
    wanted = path.removeprefix(MODELS).strip("/")
    if not wanted:
        return Response(200, json_body({"object": "list", "data": [model]}), JSON_CONTENT_TYPE)
    if wanted == model_name:
        return Response(200, json_body(model), JSON_CONTENT_TYPE)
    message = f"model {wanted!r} is not served here; this endpoint serves {model_name!r}"
    return Response(404, error_body(404, message, "model", "model_not_found"), JSON_CONTENT_TYPE)
