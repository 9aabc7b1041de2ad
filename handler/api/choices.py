"""What a request's rows carry besides the prompt: its LoRA adapters and ControlNets, by name
(checked before any file is touched, ``handler.adapters.library.valid_name``) with their settings."""

from __future__ import annotations

from typing import Any, Literal

from PIL.Image import Image
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from handler.adapters.library import valid_name
from handler.api.input_image import as_rgb, canny, read_image
from handler.api.policy import policy_of


def served_name(value: str, rule: str, what: str) -> str:
    """A LoRA's or ControlNet's name, checked before any file is touched."""
    if not valid_name(value):
        raise PydanticCustomError(rule, f"{what} of letters, digits, '_', '-' and '.' (at most 64, no '..', no path)")
    return value


class LoraChoice(BaseModel):
    """One LoRA adapter of a request and its weight."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="the LoRA's name: its file stem in the LoRA directory")
    scale: float = Field(1.0, allow_inf_nan=False, description="its weight, up to max_lora_scale either way")

    @field_validator("name")
    @classmethod
    def _a_name_not_a_path(cls, value: str) -> str:
        return served_name(value, "lora_name", "a LoRA name is a file stem")

    @field_validator("scale")
    @classmethod
    def _scale_within_limit(cls, value: float, info: ValidationInfo) -> float:
        limit = policy_of(info).limits.max_lora_scale
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

    name: str = Field(
        description="the ControlNet's name in the ControlNet directory: a diffusers directory's name or a "
        "single .safetensors file's stem"
    )
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
        return served_name(value, "controlnet_name", "a ControlNet name is a directory name or a file stem")

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
        image = as_rgb(read_image(value, policy_of(info).limits.max_input_pixels))
        if info.data.get("preprocess") == "canny":
            return canny(image, info.data.get("low_threshold", 100), info.data.get("high_threshold", 200))
        return image

    @field_validator("scale")
    @classmethod
    def _scale_within_limit(cls, value: float, info: ValidationInfo) -> float:
        limit = policy_of(info).limits.max_controlnet_scale
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
