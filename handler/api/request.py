"""The request schema: wire fields -> validated ``GenerationRequest`` -> what the engine generates.

Bounds that operators configure (``RequestLimits``) and defaults (``RequestDefaults``) are passed
as the validation context (``handler.api.policy``), so one model class serves every configuration.
Its rules, by concern, are ``handler.api.rules``; errors are reported as ``RequestError`` with one
entry per offending field, naming the field and the rule it broke (``handler.api.errors``); bodies
and forms become fields in ``handler.api.bodies``.
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any, TypeVar

from PIL.Image import Image
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator

from handler.api.choices import ControlNetChoice, LoraChoice
from handler.api.errors import RequestError, field_errors
from handler.api.input_image import fit, peek_size
from handler.api.policy import RequestPolicy, policy_of
from handler.api.rules import (
    AdapterRules,
    CacheRules,
    ImageRules,
    LimitRules,
    ScheduleRules,
    SizeConditioningRules,
    SizeRules,
    SkipLayerRules,
    StreamRules,
    TextRules,
)
from handler.config import (
    CUSTOM_SCHEDULE_FIELDS,
    MAX_CONDITIONED_SIDE,
    MAX_SEED,
    OTHER_PROMPTS,
    SIZE_CONDITIONING_FIELDS,
    SKIP_LAYER_FIELDS,
    UNET_SCHEDULERS,
    OutputFormat,
    ResponseFormat,
    SchedulerName,
    SizeConditioning,
    SkipLayerGuidance,
    SkipLayers,
    StepCache,
    guided_at,
)

# Most previews a streamed request may ask for (as the OpenAI Images API allows).
MAX_PARTIAL_IMAGES = 3

Model = TypeVar("Model", bound=BaseModel)


# Two sizes or offsets in pixels, or left out.
ConditionedPair = list[Annotated[int, Field(ge=0, le=MAX_CONDITIONED_SIDE)]] | None


def _pair(description: str) -> Any:
    """An SDXL size-conditioning field: two integers, or left out (its rules run either way: a pair's
    refusal may be that its partner is missing)."""
    return Field(None, min_length=2, max_length=2, validate_default=True, description=description)


def _window_share(where: str, default: float) -> Any:
    """A share of the steps bounding skip-layer guidance's window (its default filled where the blocks are given)."""
    return Field(
        None,
        ge=0,
        le=1,
        allow_inf_nan=False,
        validate_default=True,
        description=f"with skip_guidance_layers: the share of the steps {where} (left out: {default})",
    )


class GenerationRequest(
    TextRules,
    LimitRules,
    ScheduleRules,
    SkipLayerRules,
    SizeRules,
    StreamRules,
    AdapterRules,
    ImageRules,
    CacheRules,
    SizeConditioningRules,
):
    """One text-to-image request, in diffusers' parameter names."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    prompt: str = Field(description="what to draw; must contain a non-blank character")
    negative_prompt: str | None = Field(None, description="what to steer away from")
    prompt_2: str | None = Field(
        None, description="SDXL, SD 3.x: what the second text encoder (CLIP-G) reads; left out or empty: the prompt"
    )
    negative_prompt_2: str | None = Field(
        None,
        description="SDXL, SD 3.x: the second text encoder's negative prompt; left out or empty: the negative prompt",
    )
    prompt_3: str | None = Field(
        None, description="SD 3.x with T5: what the third text encoder (T5) reads; left out or empty: the prompt"
    )
    negative_prompt_3: str | None = Field(
        None, description="SD 3.x with T5: T5's negative prompt; left out or empty: the negative prompt"
    )
    clip_skip: int | None = Field(
        None,
        ge=0,
        description="CLIP layers the prompt skips (diffusers' clip_skip: 1 takes the layer before the one the model "
        "conditions on; on SD 1.x, A1111's 'Clip skip: 2'); the negative prompt is encoded without it, as diffusers "
        "does",
    )
    num_inference_steps: int = Field(ge=1, description="denoising steps")
    guidance_scale: float = Field(ge=0, allow_inf_nan=False, description="classifier-free guidance scale")
    guidance_rescale: float = Field(
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="with guidance, rescales the guided noise toward the spread of the prompt's own (diffusers' "
        "guidance_rescale, Lin et al. 3.4: 0 off, 0.7 suggested with v-prediction and zero terminal SNR); SD 1.x/2.x "
        "and SDXL",
    )
    skip_guidance_layers: SkipLayers | None = Field(
        None,
        min_length=1,
        description="SD 3.x, with guidance: skip-layer guidance, the transformer blocks (from 0) its extra rows skip "
        "(diffusers' skip_guidance_layers; SD 3.5 Medium's card suggests [7, 8, 9]); left out: none",
    )
    skip_layer_guidance_scale: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        validate_default=True,
        description="with skip_guidance_layers: how strongly the guidance steers away from the skipped blocks' "
        f"prediction (left out: {SkipLayerGuidance.scale})",
    )
    skip_layer_guidance_start: float | None = _window_share("after which it acts", SkipLayerGuidance.start)
    skip_layer_guidance_stop: float | None = _window_share("before which it stops acting", SkipLayerGuidance.stop)
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="seed of the first image; random if left out")
    width: int = Field(ge=8, description="image width in pixels, on the model family's grid (8, SD 3.x: 16)")
    height: int = Field(ge=8, description="image height in pixels, on the model family's grid (8, SD 3.x: 16)")
    num_images_per_prompt: int = Field(ge=1, description="images to generate for this prompt")
    scheduler: SchedulerName = Field(
        description=f"sampler used for denoising, one of the model family's: {', '.join(UNET_SCHEDULERS)} "
        "(SD 1.x/2.x, SDXL); flow_match_euler (SD 3.x)"
    )
    timesteps: list[Annotated[int, Field(ge=0)]] | None = Field(
        None,
        min_length=1,
        description="a custom schedule: the timesteps the steps run at, decreasing (diffusers' timesteps; "
        "schedulers euler, heun, dpmpp_2m and dpmpp_2m_sde); num_inference_steps follows it",
    )
    sigmas: list[Annotated[float, Field(ge=0, allow_inf_nan=False)]] | None = Field(
        None,
        min_length=1,
        description="a custom schedule: the noise levels the steps run at, decreasing (diffusers' sigmas; "
        "euler, whose list ends with the final sigma, and flow_match_euler); num_inference_steps follows it",
    )
    eta: float = Field(
        0.0,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="scheduler ddim: the fresh noise each step adds, as a share of DDPM's, drawn from the image's "
        "seed (diffusers' eta, the DDIM paper's: 0 none, deterministic; 1 as DDPM)",
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
    cache: StepCache = Field(
        description='step caching: {"mode": "deep", "interval": 3, "branch": 0} (DeepCache, UNet families: the whole '
        'UNet every interval steps, its shallow branch between), {"mode": "first_block", "threshold": 0.1} (SD 3.x: '
        "the blocks after the first skipped while its residual changes by at most threshold), or "
        '{"mode": "off"}; left out, the server\'s default'
    )
    original_size: ConditionedPair = _pair(
        "SDXL: the size [height, width] the UNet is told the training image had (diffusers' original_size); left "
        "out: the request's size"
    )
    crops_coords_top_left: ConditionedPair = _pair(
        "SDXL: the crop's top-left corner [top, left] the UNet is told of (diffusers' crops_coords_top_left); left "
        "out: [0, 0]"
    )
    target_size: ConditionedPair = _pair(
        "SDXL: the size [height, width] the UNet is told to aim for (diffusers' target_size); left out: the "
        "request's size"
    )
    negative_original_size: ConditionedPair = _pair(
        "SDXL: original_size of the unguided rows (diffusers' negative_original_size; text to image: with "
        "negative_target_size only); left out: original_size"
    )
    negative_target_size: ConditionedPair = _pair(
        "SDXL: target_size of the unguided rows (diffusers' negative_target_size; text to image: with "
        "negative_original_size only); left out: target_size"
    )
    negative_crops_coords_top_left: ConditionedPair = _pair(
        "SDXL text to image, with both negative sizes: crops_coords_top_left of the unguided rows (diffusers' "
        "negative_crops_coords_top_left); left out: [0, 0]"
    )

    @model_validator(mode="before")
    @classmethod
    def _fill_defaults(cls, data: Any, info: ValidationInfo) -> Any:
        """The configured defaults; with an input image, its size (fitted to the limits) unless
        the request gives one."""
        if not isinstance(data, dict):
            return data
        policy = policy_of(info)
        defaults = {**policy.defaults.model_dump(), "cache": policy.default_cache}
        if data.get("image") is None:
            defaults.pop("strength")
        if _unguided(data.get("guidance_scale", defaults["guidance_scale"])):
            defaults["skip_guidance_layers"] = None  # the default acts on guided requests only
        if data.get("controlnets"):  # nor on a ControlNet request, where the family's ControlNet pipeline has none
            off = {"skip_guidance_layers": None, "cache": StepCache()}
            defaults.update({field: off[field] for field in policy.rules.controlnet_excludes if field in off})
        custom = [field for field in CUSTOM_SCHEDULE_FIELDS if isinstance(data.get(field), list)]
        if custom:  # the steps of a custom schedule (the first: its rules refuse two, or steps beyond the limits)
            scheduler = data.get("scheduler")
            scheduler = scheduler if isinstance(scheduler, str) else defaults["scheduler"]
            steps = policy.rules.schedule_steps(custom[0], scheduler, len(data[custom[0]]))
            defaults["num_inference_steps"] = max(1, min(steps, policy.max_steps))
        source = data.get("image") if data.get("image") is not None else _first_control_image(data.get("controlnets"))
        if source is not None and "width" not in data and "height" not in data:
            size = peek_size(source, policy.limits.max_input_pixels)
            if size is not None:
                limits = policy.limits
                defaults["width"], defaults["height"] = fit(
                    *size, limits.min_side, policy.max_side, limits.max_pixels, policy.rules.grid
                )
        return {**defaults, **data}

    def preview_steps(self, steps: int) -> frozenset[int]:
        """The steps after which a streamed request of ``steps`` denoiser calls (fewer than
        ``num_inference_steps`` from an image with strength below 1, more with Heun or DPM2) gets a preview:
        ``partial_images`` of them, evenly spaced before the last (fewer when there are too few)."""
        parts = self.partial_images + 1
        spaced = (round(steps * index / parts) for index in range(1, parts))
        return frozenset(step for step in spaced if 0 < step < steps)

    def size_conditioning(self) -> SizeConditioning | None:
        """Its SDXL size and crop conditioning (None: none given)."""
        given = {field: tuple(getattr(self, field)) for field in SIZE_CONDITIONING_FIELDS if getattr(self, field)}
        return SizeConditioning(**given) if given else None

    def skip_layer_guidance(self) -> SkipLayerGuidance | None:
        """Its skip-layer guidance (None: none asked for)."""
        if self.skip_guidance_layers is None:
            return None
        assert self.skip_layer_guidance_scale is not None  # filled where the layers are given
        assert self.skip_layer_guidance_start is not None and self.skip_layer_guidance_stop is not None
        return SkipLayerGuidance(
            tuple(sorted(set(self.skip_guidance_layers))),
            self.skip_layer_guidance_scale,
            self.skip_layer_guidance_start,
            self.skip_layer_guidance_stop,
        )

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
        excluded |= {"cache"} if self.cache.mode == "off" else set()
        excluded |= {"clip_skip"} if self.clip_skip is None else set()
        excluded |= {field for field in CUSTOM_SCHEDULE_FIELDS if getattr(self, field) is None}
        excluded |= {"eta"} if not self.eta else set()
        excluded |= {field for field in OTHER_PROMPTS if getattr(self, field) is None}
        excluded |= {"guidance_rescale"} if not (self.guidance_rescale and guided_at(self.guidance_scale)) else set()
        excluded |= set(SKIP_LAYER_FIELDS) if self.skip_guidance_layers is None else set()
        excluded |= {field for field in SIZE_CONDITIONING_FIELDS if getattr(self, field) is None}
        if not guided_at(self.guidance_scale):  # the unguided rows' conditioning: none without guidance
            excluded |= {field for field in SIZE_CONDITIONING_FIELDS if field.startswith("negative_")}
        parameters = self.model_dump(exclude=excluded)
        if self.controlnets:  # their settings, not their images
            parameters["controlnets"] = [choice.model_dump(exclude={"image"}) for choice in self.controlnets]
        guidance = self.skip_layer_guidance()
        if guidance is not None:  # each block once, in order
            parameters["skip_guidance_layers"] = list(guidance.layers)
        return parameters


def _first_control_image(controlnets: Any) -> Any:
    """The first ControlNet's image as sent (where the request has one), whose size a request
    without a size or input image takes, as diffusers' ControlNet pipelines do."""
    if isinstance(controlnets, list) and controlnets and isinstance(controlnets[0], dict):
        return controlnets[0].get("image")
    return None


def _unguided(guidance_scale: Any) -> bool:
    """Whether a request's ``guidance_scale`` as sent (a form's as text) turns guidance off; one that is
    not a number is not, its own rules refuse it."""
    try:
        return not guided_at(float(guidance_scale))
    except (TypeError, ValueError, OverflowError):  # a JSON integer too large for a float included
        return False


# The fields the native API knows, as logs and metric labels name them.
FIELD_LABELS = frozenset({*GenerationRequest.model_fields, "body"})


def validate_model(model: type[Model], fields: dict[str, Any], policy: RequestPolicy, *, strict: bool) -> Model:
    """Validate a dict of request fields against a request model, with ``policy`` as context.
    JSON bodies are strict (no ``"20"`` for 20, no ``true`` for 1); form and query fields arrive
    as text and are converted."""
    try:
        return model.model_validate(fields, strict=strict, context=policy)
    except ValidationError as error:
        raise RequestError(field_errors(error, model.model_fields)) from None


def validate_fields(fields: dict[str, Any], policy: RequestPolicy, *, strict: bool) -> GenerationRequest:
    """Validate a dict of ``GenerationRequest`` fields."""
    return validate_model(GenerationRequest, fields, policy, strict=strict)
