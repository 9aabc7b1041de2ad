"""Which API serves a request, by the URL path after ``/predictions/{model}/{version}/``.

- ``""`` (``/predictions/{model}``, and every gRPC call): the native JSON API;
- ``v1/images/generations``, ``v1/images/edits``: the OpenAI Images API;
- ``v1/models``, ``v1/models/{id}``: answered at once, no generation;
- anything else: 404 naming the routes there are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from handler.api.encode import JSON_CONTENT_TYPE, error_json
from handler.api.openai_images import (
    EDITS,
    GENERATIONS,
    MODELS,
    ImageEditParams,
    ImageGenerationParams,
    OpenAIImages,
    error_body,
    models,
)
from handler.api.protocol import NATIVE, Api, Response

APIS: dict[str, Api] = {
    "": NATIVE,
    GENERATIONS: OpenAIImages(ImageGenerationParams, "image_generation"),
    EDITS: OpenAIImages(ImageEditParams, "image_edit"),
}
OPENAI_PREFIX = "v1/"


def route(path: str, model_name: str, extensions: Callable[[], dict[str, list[dict[str, Any]]]]) -> Api | Response:
    """The API that serves ``path``, or the whole answer where no generation is asked for
    (``extensions``: the LoRAs and ControlNets available now, for the model list)."""
    path = path.strip("/")
    if path in APIS:
        return APIS[path]
    if path == MODELS or path.startswith(MODELS + "/"):
        return models(path, model_name, extensions())
    message = (
        f"no route {path!r} under /predictions/{model_name}/<version>/; the routes are {GENERATIONS}, {EDITS} and "
        f"{MODELS} (the OpenAI Images API), and this server's JSON API at /predictions/{model_name} itself"
    )
    if path.startswith(OPENAI_PREFIX):
        return Response(404, error_body(404, message, None, "unknown_url"), JSON_CONTENT_TYPE)
    return Response(404, error_json(404, "NotFound", message), JSON_CONTENT_TYPE)
