"""The request schema: wire body -> validated ``GenerationRequest`` -> pipeline arguments.

Bounds that operators configure (``RequestLimits``) and defaults (``RequestDefaults``) are passed
as the validation context, so one model class serves every configuration. Errors are reported as
``RequestError`` with one entry per offending field, naming the field and the rule it broke.
"""

from __future__ import annotations

import json
import math
import re
import reprlib
import secrets
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from PIL.Image import Image
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from handler.config import (
    MAX_SEED,
    FamilyRules,
    OutputFormat,
    RequestDefaults,
    RequestLimits,
    ResponseFormat,
    SchedulerName,
)
from handler.input_image import as_mask, as_rgb, canny, fit, peek_size, read_image
from handler.loras import valid_name

TEXT_CONTENT_PREFIX = "text/"
# Most previews a streamed request may ask for (as the OpenAI Images API allows).
MAX_PARTIAL_IMAGES = 3
# What a list field looks like as JSON text (a form or query field), for its error.
LIST_EXAMPLES = {
    "loras": {"field": "loras", "example": '[{"name": "outline", "scale": 0.8}]'},
    "controlnets": {"field": "controlnets", "example": '[{"name": "shapes-mask", "scale": 0.9}] with file parts'},
}
# A form's file part holding the control image of a ControlNet entry.
CONTROL_FILE = re.compile(r"controlnets\.(\d{1,2})\.image")
# Fields bounded above by an operator setting in RequestLimits.
UPPER_LIMITS = {
    "num_inference_steps": "max_inference_steps",
    "guidance_scale": "max_guidance_scale",
    "num_images_per_prompt": "max_images_per_request",
}


@dataclass(frozen=True)
class FieldError:
    """One broken rule: which field, which rule, and a sentence saying what was given and allowed."""

    field: str
    rule: str
    message: str
    nested: bool = False  # a field inside a top-level one (``loras.0.name``)

    def as_dict(self) -> dict[str, str]:
        return {"field": self.field, "rule": self.rule, "message": self.message}

    def label(self, known: frozenset[str]) -> str:
        """The field as logs and metric labels name it: one of the API's ``known`` fields (a
        nested one by its top field, as ``loras`` for ``loras.0.scale``), or "body". An unknown
        field's name is the client's text (newlines, commas, colons: TorchServe's metric lines are
        log lines split on them) and unbounded, so it is ``UNKNOWN_FIELD_LABEL``."""
        field = self.field.split(".")[0] if self.nested else self.field
        return field if field in known else UNKNOWN_FIELD_LABEL


class RequestError(Exception):
    """A request that cannot be served as sent (HTTP 400)."""

    def __init__(self, errors: list[FieldError]):
        self.errors = errors
        super().__init__("; ".join(f"{e.field}: {e.message}" for e in errors))

    @classmethod
    def single(cls, field: str, rule: str, message: str) -> RequestError:
        return cls([FieldError(field, rule, message)])


@dataclass(frozen=True)
class RequestPolicy:
    """What a deployment allows and assumes: the validation context of ``GenerationRequest``."""

    limits: RequestLimits = RequestLimits()
    defaults: RequestDefaults = RequestDefaults(width=512, height=512)
    streaming: bool = False  # continuous batching: answers leave in parts and can stream progress
    over_grpc: bool = False  # the request came over gRPC, whose answers TorchServe 0.12 ends with their first part
    model_name: str = "stable-diffusion"  # the name TorchServe serves this model under
    rules: FamilyRules = FamilyRules()  # what the served model's family allows

    @property
    def max_side(self) -> int:
        """The largest width or height: the configured one, or less where the model takes less."""
        return min(self.limits.max_side, self.rules.max_side or self.limits.max_side)


Model = TypeVar("Model", bound=BaseModel)


def _policy(info: ValidationInfo) -> RequestPolicy:
    return info.context if isinstance(info.context, RequestPolicy) else RequestPolicy()


def _above_limit(value: float, limit: float, setting: str) -> PydanticCustomError:
    return PydanticCustomError(
        "less_than_equal",
        "Input should be less than or equal to {limit} (the configured {setting}), got {value}",
        {"limit": limit, "setting": setting, "value": value},
    )


def _served_name(value: str, rule: str, what: str) -> str:
    """A LoRA's or ControlNet's name, checked before any file is touched (``handler.loras.valid_name``)."""
    if not valid_name(value):
        raise PydanticCustomError(rule, f"{what} of letters, digits, '_', '-' and '.' (at most 64, no '..', no path)")
    return value


def _at_most(items: list, limit: int, what: str, setting: str) -> None:
    """Raises where a request lists more ``what`` than the configured ``setting`` allows."""
    if len(items) > limit:
        raise PydanticCustomError(
            "too_long",
            "at most {limit} {what} per request (the configured {setting}), got {count}",
            {"limit": limit, "what": what, "setting": setting, "count": len(items)},
        )


class LoraChoice(BaseModel):
    """One LoRA adapter of a request and its weight."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="the LoRA's name: its file stem in the LoRA directory")
    scale: float = Field(1.0, allow_inf_nan=False, description="its weight, up to max_lora_scale either way")

    @field_validator("name")
    @classmethod
    def _a_name_not_a_path(cls, value: str) -> str:
        return _served_name(value, "lora_name", "a LoRA name is a file stem")

    @field_validator("scale")
    @classmethod
    def _scale_within_limit(cls, value: float, info: ValidationInfo) -> float:
        limit = _policy(info).limits.max_lora_scale
        if abs(value) > limit:
            raise PydanticCustomError(
                "lora_scale",
                "a LoRA scale must be within -{limit} .. {limit} (the configured max_lora_scale), got {value}",
                {"limit": limit, "value": value},
            )
        return value


class ControlNetChoice(BaseModel):
    """One ControlNet of a request, in diffusers' terms: its control image (a map, or a photo turned
    into an edge map with ``preprocess``), ``controlnet_conditioning_scale`` and the window of steps
    it acts in (``control_guidance_start`` and ``control_guidance_end``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    name: str = Field(description="the ControlNet's name: its directory name in the ControlNet directory")
    preprocess: Literal["canny"] | None = Field(
        None, description="canny: the image is a photo, turned into an edge map (OpenCV's Canny) in the server"
    )
    low_threshold: int = Field(100, ge=0, le=1000, description="canny's lower hysteresis threshold")
    high_threshold: int = Field(
        200, ge=0, le=1000, validate_default=True, description="canny's upper hysteresis threshold"
    )
    image: Image = Field(description="the control image: base64 in JSON; a form file part controlnets.<index>.image")
    scale: float = Field(1.0, allow_inf_nan=False, description="its weight, 0 up to max_controlnet_scale")
    start: float = Field(0.0, ge=0, le=1, allow_inf_nan=False, description="share of the steps before it acts")
    end: float = Field(
        1.0,
        ge=0,
        le=1,
        allow_inf_nan=False,
        validate_default=True,
        description="share of the steps after which it stops",
    )

    @field_validator("name")
    @classmethod
    def _a_name_not_a_path(cls, value: str) -> str:
        return _served_name(value, "controlnet_name", "a ControlNet name is a directory name")

    @field_validator("high_threshold")
    @classmethod
    def _thresholds_ordered(cls, value: int, info: ValidationInfo) -> int:
        low = info.data.get("low_threshold")
        if isinstance(low, int) and value < low:
            raise PydanticCustomError(
                "threshold_order", "high_threshold {high} is below low_threshold {low}", {"high": value, "low": low}
            )
        return value

    @field_validator("image", mode="before")
    @classmethod
    def _read_control_image(cls, value: Any, info: ValidationInfo) -> Image:
        image = as_rgb(read_image(value, _policy(info).limits.max_input_pixels))
        if info.data.get("preprocess") == "canny":
            return canny(image, info.data.get("low_threshold", 100), info.data.get("high_threshold", 200))
        return image

    @field_validator("scale")
    @classmethod
    def _scale_within_limit(cls, value: float, info: ValidationInfo) -> float:
        limit = _policy(info).limits.max_controlnet_scale
        if not 0 <= value <= limit:
            raise PydanticCustomError(
                "controlnet_scale",
                "a ControlNet scale must be within 0 .. {limit} (the configured max_controlnet_scale), got {value}",
                {"limit": limit, "value": value},
            )
        return value

    @field_validator("end")
    @classmethod
    def _window_not_empty(cls, value: float, info: ValidationInfo) -> float:
        start = info.data.get("start")
        if isinstance(start, float) and value <= start:
            raise PydanticCustomError(
                "controlnet_window",
                "end {end} must be above start {start} (the ControlNet acts between these shares of the steps)",
                {"end": value, "start": start},
            )
        return value


class GenerationRequest(BaseModel):
    """One text-to-image request, in diffusers' parameter names."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    prompt: str = Field(description="what to draw; must contain a non-blank character")
    negative_prompt: str | None = Field(None, description="what to steer away from")
    num_inference_steps: int = Field(ge=1, description="denoising steps")
    guidance_scale: float = Field(ge=0, allow_inf_nan=False, description="classifier-free guidance scale")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="seed of the first image; random if left out")
    width: int = Field(ge=8, description="image width in pixels, on the model family's grid (8, SD 3.x: 16)")
    height: int = Field(ge=8, description="image height in pixels, on the model family's grid (8, SD 3.x: 16)")
    num_images_per_prompt: int = Field(ge=1, description="images to generate for this prompt")
    scheduler: SchedulerName = Field(
        description="sampler used for denoising, one of the model family's: ddim, euler, euler_a, dpmpp_2m, pndm "
        "(SD 1.x/2.x, SDXL); flow_match_euler (SD 3.x)"
    )
    output_format: OutputFormat = Field(description="encoding of the returned images")
    output_compression: int | None = Field(
        None, ge=0, le=100, description="quality of jpeg and webp images (0..100, higher is better); png ignores it"
    )
    response_format: ResponseFormat = Field(description="'image' returns raw bytes, 'json' base64 with metadata")
    stream: bool = Field(
        False, description="newline-delimited JSON progress events, then the images (continuous-batching engine)"
    )
    partial_images: int = Field(
        0, ge=0, le=MAX_PARTIAL_IMAGES, description="previews decoded from the latents while streaming, evenly spaced"
    )
    image: Image | None = Field(
        None, description="image-to-image from this picture: base64 in JSON, a file part in a form (PNG, JPEG, WebP)"
    )
    mask: Image | None = Field(
        None, description="inpainting: where this image (the input's size) is transparent, the input is repainted"
    )
    strength: float | None = Field(
        None, gt=0, le=1, allow_inf_nan=False, description="with an image: how much of the schedule it goes through"
    )
    loras: list[LoraChoice] = Field([], description="LoRA adapters from the server's LoRA directory, with scales")
    controlnets: list[ControlNetChoice] = Field(
        [], description="ControlNets from the server's ControlNet directory, each with its control image"
    )

    @model_validator(mode="before")
    @classmethod
    def _fill_defaults(cls, data: Any, info: ValidationInfo) -> Any:
        """The configured defaults; with an input image, its size (fitted to the limits) unless
        the request gives one."""
        if not isinstance(data, dict):
            return data
        policy = _policy(info)
        defaults = policy.defaults.model_dump()
        if data.get("image") is None:
            defaults.pop("strength")
        source = data.get("image") if data.get("image") is not None else _first_control_image(data.get("controlnets"))
        if source is not None and "width" not in data and "height" not in data:
            size = peek_size(source, policy.limits.max_input_pixels)
            if size is not None:
                limits = policy.limits
                defaults["width"], defaults["height"] = fit(
                    *size, limits.min_side, policy.max_side, limits.max_pixels, policy.rules.grid
                )
        return {**defaults, **data}

    @field_validator("prompt")
    @classmethod
    def _prompt_not_blank(cls, value: str, info: ValidationInfo) -> str:
        if not value.strip():
            raise PydanticCustomError("non_blank", "prompt must contain a non-blank character")
        return cls._prompt_text(value, info)

    @field_validator("negative_prompt")
    @classmethod
    def _negative_prompt_length(cls, value: str | None, info: ValidationInfo) -> str | None:
        return value if value is None else cls._prompt_text(value, info)

    @staticmethod
    def _prompt_text(value: str, info: ValidationInfo) -> str:
        """Text the tokenizer can read (JSON's \\ud800-\\udfff escapes can carry lone surrogates,
        which it refuses), within max_prompt_chars."""
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise PydanticCustomError(
                "string_unicode",
                "String should be valid Unicode: lone surrogate {code} at character {position} (a \\ud800-\\udbff "
                "escape must be followed by a \\udc00-\\udfff one)",
                {"code": f"\\u{ord(value[error.start]):04x}", "position": error.start},
            ) from None
        limit = _policy(info).limits.max_prompt_chars
        if len(value) > limit:
            raise PydanticCustomError(
                "string_too_long",
                "String should have at most {limit} characters (the configured max_prompt_chars), got {length}",
                {"limit": limit, "length": len(value)},
            )
        return value

    @field_validator(*UPPER_LIMITS)
    @classmethod
    def _within_upper_limit(cls, value: float, info: ValidationInfo) -> float:
        setting = UPPER_LIMITS[str(info.field_name)]
        limit = getattr(_policy(info).limits, setting)
        if value > limit:
            raise _above_limit(value, limit, setting)
        return value

    @field_validator("scheduler", mode="before")
    @classmethod
    def _scheduler_of_the_family(cls, value: Any, info: ValidationInfo) -> Any:
        rules = _policy(info).rules
        if value not in rules.schedulers:
            names = [f"'{name}'" for name in rules.schedulers]
            allowed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
            raise PydanticCustomError(
                "literal_error",
                "Input should be {allowed} (the schedulers of {family} models)",
                {"allowed": allowed, "family": rules.family},
            )
        return value

    @field_validator("width", "height")
    @classmethod
    def _side_within_limits(cls, value: int, info: ValidationInfo) -> int:
        policy = _policy(info)
        limits, rules = policy.limits, policy.rules
        if value % rules.grid:
            raise PydanticCustomError(
                "multiple_of",
                "Input should be a multiple of {grid} for {family} models",
                {"grid": rules.grid, "family": rules.family},
            )
        if value < limits.min_side:
            raise PydanticCustomError(
                "greater_than_equal",
                "Input should be greater than or equal to {limit} (the configured min_side), got {value}",
                {"limit": limits.min_side, "value": value},
            )
        if value > limits.max_side:
            raise _above_limit(value, limits.max_side, "max_side")
        if value > policy.max_side:
            raise PydanticCustomError(
                "less_than_equal",
                "Input should be less than or equal to {limit} (the largest side this {family} model's denoiser "
                "takes), got {value}",
                {"limit": policy.max_side, "family": rules.family, "value": value},
            )
        if info.field_name == "height" and isinstance(info.data.get("width"), int):
            pixels = info.data["width"] * value
            if pixels > limits.max_pixels:
                raise PydanticCustomError(
                    "pixel_budget",
                    "width x height = {width} x {height} = {pixels} pixels is more than the configured "
                    "max_pixels {limit}",
                    {"width": info.data["width"], "height": value, "pixels": pixels, "limit": limits.max_pixels},
                )
        return value

    @field_validator("stream")
    @classmethod
    def _stream_needs_the_step_engine(cls, value: bool, info: ValidationInfo) -> bool:
        policy = _policy(info)
        if value and policy.over_grpc:
            raise PydanticCustomError(
                "streaming_unavailable",
                "stream is not available over gRPC: TorchServe 0.12 ends a gRPC call with the first part of an "
                "answer, so progress streams over HTTP only",
            )
        if value and not policy.streaming:
            raise PydanticCustomError(
                "streaming_unavailable",
                "stream needs the continuous-batching engine (continuousBatching: true in model-config.yaml); "
                "this model runs dynamic batching",
            )
        return value

    @field_validator("loras", "controlnets", mode="before")
    @classmethod
    def _list_from_text(cls, value: Any, info: ValidationInfo) -> Any:
        """A form or query field carries the list as JSON text."""
        if isinstance(value, str):
            try:
                return json.loads(value)
            except ValueError:
                raise PydanticCustomError(
                    "json", "{field} in a form is JSON text such as {example}", LIST_EXAMPLES[str(info.field_name)]
                ) from None
        return value

    @field_validator("loras")
    @classmethod
    def _loras_within_limits(cls, value: list[LoraChoice], info: ValidationInfo) -> list[LoraChoice]:
        _at_most(value, _policy(info).limits.max_loras_per_request, "LoRAs", "max_loras_per_request")
        names = [choice.name for choice in value]
        if len(set(names)) != len(names):
            raise PydanticCustomError("lora_repeated", "each LoRA at most once per request (give it one scale)")
        return value

    @field_validator("controlnets")
    @classmethod
    def _controlnets_served(cls, value: list[ControlNetChoice], info: ValidationInfo) -> list[ControlNetChoice]:
        policy = _policy(info)
        if value and not policy.rules.controlnets:
            raise PydanticCustomError(
                "controlnets_unavailable",
                "ControlNets are served for SD 1.x/2.x and SDXL models; this is an {family} model",
                {"family": policy.rules.family},
            )
        if value and info.data.get("mask") is not None:
            raise PydanticCustomError(
                "controlnets_with_mask",
                "ControlNets are served with text-to-image and image-to-image, not inpainting (leave out mask)",
            )
        _at_most(value, policy.limits.max_controlnets_per_request, "ControlNets", "max_controlnets_per_request")
        return value

    @field_validator("image", mode="before")
    @classmethod
    def _read_image(cls, value: Any, info: ValidationInfo) -> Image | None:
        return None if value is None else as_rgb(read_image(value, _policy(info).limits.max_input_pixels))

    @field_validator("mask", mode="before")
    @classmethod
    def _read_mask(cls, value: Any, info: ValidationInfo) -> Image | None:
        if value is None or "image" not in info.data:  # no mask, or the image already failed
            return None
        image = info.data["image"]
        if image is None:
            raise PydanticCustomError("needs_image", "a mask needs an image to inpaint (the image field)")
        mask = read_image(value, _policy(info).limits.max_input_pixels)
        if mask.size != image.size:
            raise PydanticCustomError(
                "mask_size",
                "the mask is {mask}, the image {image}: they must be the same size",
                {"mask": "x".join(map(str, mask.size)), "image": "x".join(map(str, image.size))},
            )
        return as_mask(mask)

    @field_validator("strength")
    @classmethod
    def _strength_needs_an_image_and_a_step(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is None or "image" not in info.data:
            return value
        if info.data["image"] is None:
            raise PydanticCustomError("needs_image", "strength applies to an input image (the image field)")
        steps = info.data.get("num_inference_steps")
        if isinstance(steps, int) and _policy(info).rules.image_steps(steps, value) < 1:
            raise PydanticCustomError(
                "no_steps",
                "strength {strength} of {steps} steps leaves no denoising step (the image-to-image pipeline of "
                "{family} models rounds {steps} x {strength} down to 0): raise strength or num_inference_steps",
                {"strength": value, "steps": steps, "family": _policy(info).rules.family},
            )
        return value

    @field_validator("partial_images")
    @classmethod
    def _partial_images_need_a_stream(cls, value: int, info: ValidationInfo) -> int:
        if value and info.data.get("stream") is not True:
            raise PydanticCustomError(
                "needs_stream", "partial_images needs stream: true (previews are parts of a streamed answer)"
            )
        return value

    def preview_steps(self, steps: int) -> frozenset[int]:
        """The steps after which a streamed request of ``steps`` denoising steps (fewer than
        ``num_inference_steps`` from an image with strength below 1) gets a preview:
        ``partial_images`` of them, evenly spaced before the last (fewer when there are too few)."""
        parts = self.partial_images + 1
        spaced = (round(steps * index / parts) for index in range(1, parts))
        return frozenset(step for step in spaced if 0 < step < steps)

    def with_seed(self) -> GenerationRequest:
        """This request with a concrete seed, drawn at random when the client sent none."""
        if self.seed is not None:
            return self
        return self.model_copy(update={"seed": secrets.randbelow(MAX_SEED + 1)})

    def image_seeds(self) -> list[int]:
        """One seed per image: ``seed``, ``seed + 1``, ... so every image is reproducible alone."""
        if self.seed is None:
            raise ValueError("image_seeds() needs a concrete seed; call with_seed() first")
        return [(self.seed + index) % (MAX_SEED + 1) for index in range(self.num_images_per_prompt)]

    def parameters(self) -> dict[str, Any]:
        """The effective parameters, as reported back to the client."""
        excluded = {"output_format", "output_compression", "response_format", "stream", "partial_images", "mask"}
        excluded |= {"image"} if self.image is not None else {"image", "strength"}
        excluded |= {"controlnets"} if self.loras else {"controlnets", "loras"}
        parameters = self.model_dump(exclude=excluded)
        if self.controlnets:  # their settings, not their images
            parameters["controlnets"] = [choice.model_dump(exclude={"image"}) for choice in self.controlnets]
        return parameters


def _first_control_image(controlnets: Any) -> Any:
    """The first ControlNet's image as sent (where the request has one), whose size a request
    without a size or input image takes, as diffusers' ControlNet pipelines do."""
    if isinstance(controlnets, str):
        try:
            controlnets = json.loads(controlnets)
        except ValueError:
            return None
    if isinstance(controlnets, list) and controlnets and isinstance(controlnets[0], dict):
        return controlnets[0].get("image")
    return None


UNKNOWN_FIELD_LABEL = "unknown_field"
FIELD_LABELS = frozenset({*GenerationRequest.model_fields, "body"})


def _field_errors(error: ValidationError, allowed: Iterable[str]) -> list[FieldError]:
    errors = []
    for item in error.errors(include_url=False):
        field = ".".join(str(part) for part in item["loc"]) or "body"
        rule, message = item["type"], item["msg"]
        if rule == "extra_forbidden":
            rule = "unknown_field"
            message = f"unknown field {field!r}; allowed fields: {', '.join(allowed)}"
        elif rule != "missing" and "input" in item:
            given = _short_repr(item["input"])
            if given not in message:
                message = f"{message} (given: {given})"
        errors.append(FieldError(field, rule, message, nested=len(item["loc"]) > 1))
    return errors


def _short_repr(value: Any, limit: int = 60) -> str:
    text = json.dumps(value) if _json_safe(value) else reprlib.repr(value)  # reprlib: bounded depth and length
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _json_safe(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, (str, int, bool, type(None)))


def validate_model(model: type[Model], fields: dict[str, Any], policy: RequestPolicy, *, strict: bool) -> Model:
    """Validate a dict of request fields against a request model, with ``policy`` as context.
    JSON bodies are strict (no ``"20"`` for 20, no ``true`` for 1); form and query fields arrive
    as text and are converted."""
    try:
        return model.model_validate(fields, strict=strict, context=policy)
    except ValidationError as error:
        raise RequestError(_field_errors(error, model.model_fields)) from None


def validate_fields(fields: dict[str, Any], policy: RequestPolicy, *, strict: bool) -> GenerationRequest:
    """Validate a dict of ``GenerationRequest`` fields."""
    return validate_model(GenerationRequest, fields, policy, strict=strict)


def _decode_text(raw: bytes | bytearray) -> str:
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError as error:
        raise RequestError.single(
            "body", "utf8", f"body is not valid UTF-8: {error.reason} at byte {error.start}"
        ) from None


def _parse_json(raw: bytes | bytearray) -> Any:
    text = _decode_text(raw)
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise RequestError.single(
            "body", "json", f"body is not valid JSON: {error.msg} at line {error.lineno} column {error.colno}"
        ) from None
    except RecursionError:
        raise RequestError.single("body", "json", "body is nested too deeply") from None
    except ValueError:  # json.loads reads integers of up to sys.get_int_max_str_digits() digits
        raise RequestError.single(
            "body",
            "json",
            f"body has a number of more than {sys.get_int_max_str_digits()} digits, longer than this server reads",
        ) from None


def _json_type_name(value: Any) -> str:
    names = {list: "array", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def decode_body(body: Any, content_type: str | None, policy: RequestPolicy) -> GenerationRequest:
    """Turn the body TorchServe hands over into a request.

    TorchServe pre-decodes JSON (dict/list/str/number) and text (str); what it could not decode
    arrives as raw bytes. A ``text/*`` body is the prompt alone. A body with no Content-Type (as
    TorchServe's own diffusers example and gRPC clients send it) is JSON when it starts with ``{`` or
    ``[``, else the prompt; everything else must be a JSON object of request fields.
    """
    media_type = (content_type or "").split(";")[0].strip().lower()
    is_text = media_type.startswith(TEXT_CONTENT_PREFIX)
    if isinstance(body, (bytes, bytearray)):
        if not body.strip():
            raise RequestError.single(
                "body",
                "required",
                'body is empty (or JSON null): send a JSON object such as {"prompt": "a red circle"}',
            )
        if is_text:
            body = _decode_text(body)
        elif media_type:
            body = _parse_json(body)
        else:
            body, is_text = _json_or_prompt(body)
    if is_text and isinstance(body, str):
        return validate_fields({"prompt": body}, policy, strict=True)
    fields = json_fields(body, "a JSON object of request fields (or a text/plain prompt)")
    return validate_fields(fields, policy, strict=True)


def json_fields(body: Any, expected: str = "a JSON object of request fields") -> dict[str, Any]:
    """The fields of a JSON object body, pre-decoded or raw (parsed as UTF-8 JSON)."""
    if isinstance(body, (bytes, bytearray)):
        if not body.strip():
            raise RequestError.single("body", "required", f"body is empty (or JSON null): send {expected}")
        body = _parse_json(body)
    if not isinstance(body, dict):
        raise RequestError.single("body", "object", f"body must be {expected}, got a JSON {_json_type_name(body)}")
    return body


def _json_or_prompt(raw: bytes | bytearray) -> tuple[Any, bool]:
    """A body sent without a Content-Type: JSON when it starts with ``{`` or ``[`` (so a mistyped
    JSON object gets its 400), else its text as the prompt."""
    text = _decode_text(raw)
    if text.lstrip().startswith(("{", "[")):
        return _parse_json(raw), False
    return text, True


# Form fields that carry files, not text.
FILE_FIELDS = frozenset({"image", "mask"})


def form_text(fields: dict[str, Any]) -> dict[str, Any]:
    """Form or query fields, which arrive as text or bytes per field, as text (files as bytes), the
    control images' file parts (``controlnets.<index>.image``) in their ControlNet entries."""
    files = {name: value for name, value in fields.items() if CONTROL_FILE.fullmatch(name)}
    text = {
        name: _decode_text(value) if isinstance(value, (bytes, bytearray)) and name not in FILE_FIELDS else value
        for name, value in fields.items()
        if name not in files
    }
    return _with_control_files(text, files) if files else text


def _with_control_files(fields: dict[str, Any], files: dict[str, Any]) -> dict[str, Any]:
    """Each ``controlnets.<index>.image`` file part as the image of ControlNet entry ``index``."""
    entries = fields.get("controlnets")
    if isinstance(entries, str):
        try:
            entries = json.loads(entries)
        except ValueError:
            return fields  # the controlnets field's own error says why
    for name, data in files.items():
        index = int(CONTROL_FILE.fullmatch(name).group(1))  # type: ignore[union-attr]  # matched above
        if not isinstance(entries, list) or index >= len(entries) or not isinstance(entries[index], dict):
            message = f"the file part {name} needs a controlnets entry {index} to be the image of"
            raise RequestError([FieldError(name, "no_controlnet", message, nested=True)])
        entries[index] = {**entries[index], "image": data}
    return {**fields, "controlnets": entries}


def decode_form(fields: dict[str, Any], policy: RequestPolicy) -> GenerationRequest:
    """Validate form or query fields."""
    return validate_fields(form_text(fields), policy, strict=False)
