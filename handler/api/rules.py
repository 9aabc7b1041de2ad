"""The rules of a ``GenerationRequest``, by concern: each class holds the validators of one group of
fields (the text, the operator's limits, the size, streaming, LoRAs and ControlNets, an input
image, the step cache), and the request model takes them all. A rule reads the deployment's ``RequestPolicy``
(``handler.api.policy``) and fields validated before its own (``info.data``, in field order)."""

from __future__ import annotations

from typing import Any

from PIL.Image import Image
from pydantic import BaseModel, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from handler.api.choices import ControlNetChoice, LoraChoice
from handler.api.input_image import as_mask, as_rgb, read_image
from handler.api.policy import above_limit, above_model_limit, at_most, policy_of
from handler.config import (
    CUSTOM_SCHEDULE_FIELDS,
    OTHER_PROMPTS,
    SIZE_CONDITIONING_FIELDS,
    SKIP_LAYER_FIELDS,
    FamilyRules,
    SkipLayerGuidance,
    StepCache,
    guided_at,
)

# What a list field looks like, for its error (in a form or query: that list as JSON text).
LIST_EXAMPLES = {
    "loras": {"field": "loras", "example": '[{"name": "outline", "scale": 0.8}]'},
    "controlnets": {"field": "controlnets", "example": '[{"name": "shapes-mask", "scale": 0.9}] with file parts'},
    "skip_guidance_layers": {"field": "skip_guidance_layers", "example": "[7, 8, 9]"},
    "timesteps": {"field": "timesteps", "example": "[999, 845, 730, 587]"},
    "sigmas": {
        "field": "sigmas",
        "example": "[14.615, 6.475, 3.861, 0.0] (euler) or [1.0, 0.75, 0.5] (flow_match_euler)",
    },
    **{field: {"field": field, "example": "[1024, 1024]"} for field in SIZE_CONDITIONING_FIELDS},
}
# Fields bounded above by an operator setting in RequestLimits.
UPPER_LIMITS = {
    "num_inference_steps": "max_inference_steps",
    "guidance_scale": "max_guidance_scale",
    "num_images_per_prompt": "max_images_per_request",
}

# What OTHER_PROMPTS's encoders are, in a refusal's words.
ENCODER_NAMES = {2: "a second text encoder (CLIP-G)", 3: "a third text encoder (T5)"}


# What a family's pipelines may not take, in a refusal's words.
SKIP_LAYER_GUIDANCE = (
    "skip-layer guidance is served for SD 3.x models (StableDiffusion3Pipeline's skip_guidance_layers)"
)
SIZE_CONDITIONING = "size and crop conditioning is SDXL's (its UNet's time ids: original_size, target_size, ...)"


def controlnets_without(field: str, family: str) -> PydanticCustomError:
    """A request with ControlNets and ``field``, which the family's ControlNet pipelines take none of."""
    return PydanticCustomError(
        "controlnets_with",
        "ControlNets on {family} models are served with text to image alone, as diffusers' ControlNet pipeline "
        "for it takes no {field}: leave out {field} or controlnets",
        {"family": family, "field": field},
    )


def _not_served(rule: str, what: str, field: str, rules: FamilyRules) -> PydanticCustomError:
    """A refusal of a field this family's pipelines do not take: what it is, and to leave it out."""
    return PydanticCustomError(
        rule,
        "{what}; this is an {family} model: leave {field} out",
        {"what": what, "family": rules.family, "field": field},
    )


class TextRules(BaseModel):
    """The prompts and negative prompts: text the tokenizer reads, within the configured length,
    each for a text encoder the model is served with; the CLIP layers the prompt skips, within the
    model's text encoders."""

    @field_validator("prompt", check_fields=False)
    @classmethod
    def _prompt_not_blank(cls, value: str, info: ValidationInfo) -> str:
        if not value.strip():
            raise PydanticCustomError("non_blank", "prompt must contain a non-blank character")
        return cls._prompt_text(value, info)

    @field_validator("negative_prompt", check_fields=False)
    @classmethod
    def _negative_prompt_length(cls, value: str | None, info: ValidationInfo) -> str | None:
        return value if value is None else cls._prompt_text(value, info)

    @field_validator(*OTHER_PROMPTS, check_fields=False)
    @classmethod
    def _prompt_of_a_served_encoder(cls, value: str | None, info: ValidationInfo) -> str | None:
        """``prompt_2``/``prompt_3`` and their negatives where the model has that text encoder; a
        ``negative_prompt_2`` that would be encoded (not where an absent negative prompt is zeros)."""
        if value is None:
            return value
        field, rules = str(info.field_name), policy_of(info).rules
        if OTHER_PROMPTS[field] > rules.text_encoders:
            raise PydanticCustomError(
                "prompt_unavailable",
                "{field} is for {encoder}, which this {family} model is served without: leave it out (SDXL models "
                "read prompt_2 and negative_prompt_2; SD 3.x models also prompt_3 and negative_prompt_3 where "
                "served with T5)",
                {"field": field, "encoder": ENCODER_NAMES[OTHER_PROMPTS[field]], "family": rules.family},
            )
        # negative_prompt is validated before (declared first); where it failed, it is not in info.data
        if (
            value
            and field == "negative_prompt_2"
            and rules.zeros_without_negative
            and info.data.get("negative_prompt", "") is None
        ):
            raise PydanticCustomError(
                "negative_prompt_missing",
                "negative_prompt_2 is encoded only beside a negative_prompt: without one this {family} model's "
                "unguided rows are zeros (its force_zeros_for_empty_prompt, as in diffusers); give negative_prompt "
                'too ("" for none)',
                {"family": rules.family},
            )
        return cls._prompt_text(value, info)

    @field_validator("clip_skip", check_fields=False)
    @classmethod
    def _clip_skip_within_the_encoders(cls, value: int | None, info: ValidationInfo) -> int | None:
        rules = policy_of(info).rules
        if value is not None and value > rules.max_clip_skip:
            what = f"the most layers this {rules.family} model's CLIP text encoders can skip, keeping one"
            raise above_model_limit(value, rules.max_clip_skip, what)
        return value

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
        limit = policy_of(info).limits.max_prompt_chars
        if len(value) > limit:
            raise PydanticCustomError(
                "string_too_long",
                "String should have at most {limit} characters (the configured max_prompt_chars), got {length}",
                {"limit": limit, "length": len(value)},
            )
        return value


class LimitRules(BaseModel):
    """The operator's upper limits and the model family's schedulers, schedule and guidance."""

    @field_validator(*UPPER_LIMITS, check_fields=False)
    @classmethod
    def _within_upper_limit(cls, value: float, info: ValidationInfo) -> float:
        setting = UPPER_LIMITS[str(info.field_name)]
        policy = policy_of(info)
        limit = getattr(policy.limits, setting)
        if value > limit:
            raise above_limit(value, limit, setting)
        rules = policy.rules
        if info.field_name == "num_inference_steps" and rules.max_steps is not None and value > rules.max_steps:
            raise above_model_limit(
                value, rules.max_steps, f"the most steps this {rules.family} model's schedules take"
            )
        return value

    @field_validator("guidance_rescale", check_fields=False)
    @classmethod
    def _guidance_rescale_of_the_family(cls, value: float, info: ValidationInfo) -> float:
        rules = policy_of(info).rules
        if value and not rules.guidance_rescale:
            raise PydanticCustomError(
                "guidance_rescale_unavailable",
                "guidance_rescale is served for SD 1.x/2.x and SDXL models (their pipelines take it); this is an "
                "{family} model: leave it out or 0",
                {"family": rules.family},
            )
        return value

    @field_validator("scheduler", mode="before", check_fields=False)
    @classmethod
    def _scheduler_of_the_family(cls, value: Any, info: ValidationInfo) -> Any:
        rules = policy_of(info).rules
        if value not in rules.schedulers:
            names = [f"'{name}'" for name in rules.schedulers]
            allowed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
            raise PydanticCustomError(
                "literal_error",
                "Input should be {allowed} (the schedulers of {family} models)",
                {"allowed": allowed, "family": rules.family},
            )
        return value


class ScheduleRules(BaseModel):
    """A custom schedule (``timesteps`` or ``sigmas``, not both, as ``retrieve_timesteps`` takes
    one): for a scheduler that takes it, decreasing, within its range, and running the request's
    ``num_inference_steps`` (which follows it where left out); ``eta`` for a scheduler it acts on."""

    @field_validator("eta", check_fields=False)
    @classmethod
    def _eta_of_the_scheduler(cls, value: float, info: ValidationInfo) -> float:
        scheduler, rules = info.data.get("scheduler"), policy_of(info).rules
        if value and scheduler is not None and scheduler not in rules.eta_schedulers:
            takers = " or ".join(rules.eta_schedulers)
            advice = (
                "{takers} does: name it, or leave eta out (or 0)"
                if takers
                else "nor do its others: leave eta out (or 0)"
            )
            raise PydanticCustomError(
                "eta_unavailable",
                "eta acts on DDIM's steps (diffusers passes it to a scheduler whose step takes it): scheduler "
                "{scheduler} on this {family} model takes none; " + advice,
                {"scheduler": scheduler, "family": rules.family, "takers": takers},
            )
        return value

    @field_validator(*CUSTOM_SCHEDULE_FIELDS, check_fields=False)
    @classmethod
    def _schedule_of_the_scheduler(cls, value: list[float] | None, info: ValidationInfo) -> list[float] | None:
        field, rules = str(info.field_name), policy_of(info).rules
        if value is None:
            return value
        if field == "sigmas" and "timesteps" not in info.data:  # they failed their own rules: sent both
            return value
        if field == "sigmas" and info.data["timesteps"] is not None:
            raise PydanticCustomError(
                "timesteps_and_sigmas", "give timesteps or sigmas, not both (a custom schedule is one of them)"
            )
        scheduler = info.data.get("scheduler")
        if scheduler is None:  # it failed its own rules
            return value
        problem = rules.schedule_problem(field, scheduler, value)
        if problem:
            raise PydanticCustomError(*problem)
        steps, given = rules.schedule_steps(field, scheduler, len(value)), info.data.get("num_inference_steps")
        limit = policy_of(info).max_steps
        if steps > limit:
            raise PydanticCustomError(
                "too_long",
                "these {count} {field} run {steps} steps, more than the {limit} a request may run here "
                "(max_inference_steps, and what this model's schedules take)",
                {"count": len(value), "field": field, "steps": steps, "limit": limit},
            )
        if given is not None and given != steps:
            raise PydanticCustomError(
                "steps_mismatch",
                "these {count} {field} run {steps} steps, but num_inference_steps is {given}: leave "
                "num_inference_steps out (it follows {field}) or make it {steps}",
                {"count": len(value), "field": field, "steps": steps, "given": given},
            )
        return value


class SkipLayerRules(BaseModel):
    """Skip-layer guidance: SD 3.x's, with guidance, over blocks the model's transformer has; its
    settings only beside its blocks (left out there: diffusers' defaults)."""

    @field_validator("skip_guidance_layers", check_fields=False)
    @classmethod
    def _blocks_of_the_transformer(cls, value: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if value is None:
            return value
        rules = policy_of(info).rules
        if not rules.transformer_blocks:
            raise _not_served("skip_layer_guidance_unavailable", SKIP_LAYER_GUIDANCE, "skip_guidance_layers", rules)
        problem = rules.skip_layers_problem(value)
        if problem:
            raise PydanticCustomError(*problem)
        _guided_for("skip_guidance_layers", info)
        return value

    @field_validator(*SKIP_LAYER_FIELDS[1:], check_fields=False)  # the settings after the blocks
    @classmethod
    def _setting_beside_its_blocks(cls, value: float | None, info: ValidationInfo) -> float | None:
        """Given only with ``skip_guidance_layers`` (diffusers would ignore it); left out beside
        them, diffusers' default; the scale within ``max_guidance_scale``, the start before the stop."""
        field, rules = str(info.field_name), policy_of(info).rules
        if value is not None and not rules.transformer_blocks:
            raise _not_served("skip_layer_guidance_unavailable", SKIP_LAYER_GUIDANCE, field, rules)
        if "skip_guidance_layers" not in info.data:  # it failed its own rules: nothing to add
            return value
        if info.data["skip_guidance_layers"] is None:
            if value is not None:
                _guided_for(field, info)  # an unguided request: the blocks would not help (nor a default's)
                raise PydanticCustomError(
                    "skip_guidance_layers_missing",
                    "{field} sets skip-layer guidance, which skip_guidance_layers turns on: give the blocks "
                    "(such as [7, 8, 9]) or leave {field} out",
                    {"field": field},
                )
            return value
        given = value is not None
        if value is None:
            value = getattr(SkipLayerGuidance, field.removeprefix("skip_layer_guidance_"))
        if field == "skip_layer_guidance_scale":
            limit = policy_of(info).limits.max_guidance_scale
            if value > limit:
                raise above_limit(value, limit, "max_guidance_scale")
        start = info.data.get("skip_layer_guidance_start")
        if field == "skip_layer_guidance_stop" and start is not None and value <= start:
            raise PydanticCustomError(
                "stop_before_start",
                "skip_layer_guidance_stop ({stop}{default}) must be above skip_layer_guidance_start ({start}): "
                "between them no step would be guided",
                {"stop": value, "start": start, "default": "" if given else ", its default where left out"},
            )
        return value


def _guided_for(field: str, info: ValidationInfo) -> None:
    """Refuses ``field`` (skip-layer guidance's) on a request whose ``guidance_scale`` turns guidance off."""
    guidance = info.data.get("guidance_scale")  # absent where it failed its own rules
    if guidance is not None and not guided_at(guidance):
        raise PydanticCustomError(
            "guidance_needed",
            "skip-layer guidance acts on classifier-free guidance, which a guidance_scale of {guidance} turns "
            "off (diffusers ignores {field} there): give guidance_scale above 1, or leave {field} out",
            {"guidance": guidance, "field": field},
        )


class SizeRules(BaseModel):
    """Width and height: on the family's grid, within the sides and pixels configured and the denoiser takes."""

    @field_validator("width", "height", check_fields=False)
    @classmethod
    def _side_within_limits(cls, value: int, info: ValidationInfo) -> int:
        policy = policy_of(info)
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
            raise above_limit(value, limits.max_side, "max_side")
        if value > policy.max_side:
            what = f"the largest side this {rules.family} model's denoiser takes"
            raise above_model_limit(value, policy.max_side, what)
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


class StreamRules(BaseModel):
    """Streaming: only with the continuous-batching engine over HTTP; previews only in a stream."""

    @field_validator("stream", check_fields=False)
    @classmethod
    def _stream_needs_the_step_engine(cls, value: bool, info: ValidationInfo) -> bool:
        policy = policy_of(info)
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

    @field_validator("partial_images", check_fields=False)
    @classmethod
    def _partial_images_need_a_stream(cls, value: int, info: ValidationInfo) -> int:
        if value and info.data.get("stream") is not True:
            raise PydanticCustomError(
                "needs_stream", "partial_images needs stream: true (previews are parts of a streamed answer)"
            )
        return value


class AdapterRules(BaseModel):
    """LoRAs and ControlNets: lists (a form's JSON text is parsed before), within the limits, where
    the family takes them."""

    @field_validator(*LIST_EXAMPLES, mode="before", check_fields=False)
    @classmethod
    def _a_list_not_text(cls, value: Any, info: ValidationInfo) -> Any:
        """A form's list fields were parsed from their JSON text (``handler.api.bodies``); text left
        here was no JSON."""
        if isinstance(value, str):
            raise PydanticCustomError(
                "json",
                "{field} is a list such as {example}; in a form, that list as JSON text",
                LIST_EXAMPLES[str(info.field_name)],
            )
        return value

    @field_validator("loras", check_fields=False)
    @classmethod
    def _loras_within_limits(cls, value: list[LoraChoice], info: ValidationInfo) -> list[LoraChoice]:
        at_most(value, policy_of(info).limits.max_loras_per_request, "LoRAs", "max_loras_per_request")
        names = [choice.name for choice in value]
        if len(set(names)) != len(names):
            raise PydanticCustomError("lora_repeated", "each LoRA at most once per request (give it one scale)")
        return value

    @field_validator("controlnets", check_fields=False)
    @classmethod
    def _controlnets_served(cls, value: list[ControlNetChoice], info: ValidationInfo) -> list[ControlNetChoice]:
        policy = policy_of(info)
        if value and not policy.rules.controlnets:
            raise PydanticCustomError(
                "controlnets_unavailable", "this {family} model takes no ControlNets", {"family": policy.rules.family}
            )
        # Those declared before it (the cache's own rule refuses a cache).
        excluded = [field for field in policy.rules.controlnet_excludes if info.data.get(field) is not None]
        if value and excluded:
            raise controlnets_without(excluded[0], policy.rules.family)
        if value and info.data.get("mask") is not None:
            raise PydanticCustomError(
                "controlnets_with_mask",
                "ControlNets are served with text-to-image and image-to-image, not inpainting (leave out mask)",
            )
        at_most(value, policy.limits.max_controlnets_per_request, "ControlNets", "max_controlnets_per_request")
        return value


class ImageRules(BaseModel):
    """An input image, its mask and strength: read and checked, a mask of the image's size, a
    strength that leaves a step."""

    @field_validator("image", mode="before", check_fields=False)
    @classmethod
    def _read_image(cls, value: Any, info: ValidationInfo) -> Image | None:
        return None if value is None else as_rgb(read_image(value, policy_of(info).limits.max_input_pixels))

    @field_validator("image", check_fields=False)
    @classmethod
    def _no_two_call_schedule_from_it(cls, value: Image | None, info: ValidationInfo) -> Image | None:
        """Custom timesteps of a scheduler that runs two calls a step (Heun) start from noise only:
        diffusers' image pipelines take the schedule's calls for its steps (``retrieve_timesteps``)
        and cut it twice as far (``get_timesteps``), which leaves no step below about strength 0.5."""
        scheduler, rules = info.data.get("scheduler"), policy_of(info).rules
        if value is not None and info.data.get("timesteps") is not None and scheduler in rules.two_call_schedulers:
            raise PydanticCustomError(
                "custom_schedule_from_image",
                "scheduler {scheduler} runs custom timesteps from text only (two denoiser calls a step: from an "
                "image, diffusers' pipelines cut its schedule by its calls, not its steps): leave timesteps out, "
                "or name {others}",
                {
                    "scheduler": scheduler,
                    "others": " or ".join(
                        name for name in rules.schedulers_taking("timesteps") if name not in rules.two_call_schedulers
                    ),
                },
            )
        return value

    @field_validator("mask", mode="before", check_fields=False)
    @classmethod
    def _read_mask(cls, value: Any, info: ValidationInfo) -> Image | None:
        if value is None or "image" not in info.data:  # no mask, or the image already failed
            return None
        image = info.data["image"]
        if image is None:
            raise PydanticCustomError("needs_image", "a mask needs an image to inpaint (the image field)")
        mask = read_image(value, policy_of(info).limits.max_input_pixels)
        if mask.size != image.size:
            raise PydanticCustomError(
                "mask_size",
                "the mask is {mask}, the image {image}: they must be the same size",
                {"mask": "x".join(map(str, mask.size)), "image": "x".join(map(str, image.size))},
            )
        return as_mask(mask)

    @field_validator("strength", check_fields=False)
    @classmethod
    def _strength_needs_an_image_and_a_step(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is None or "image" not in info.data:
            return value
        if info.data["image"] is None:
            raise PydanticCustomError("needs_image", "strength applies to an input image (the image field)")
        steps = info.data.get("num_inference_steps")
        if isinstance(steps, int) and policy_of(info).rules.image_steps(steps, value) < 1:
            raise PydanticCustomError(
                "no_steps",
                "strength {strength} of {steps} steps leaves no denoising step (the image-to-image pipeline of "
                "{family} models rounds {steps} x {strength} down to 0): raise strength or num_inference_steps "
                "(with timesteps or sigmas: give more of them)",
                {"strength": value, "steps": steps, "family": policy_of(info).rules.family},
            )
        return value


CACHES_SERVED_BY = {
    "deep": "DeepCache (deep) is served for SD 1.x/2.x and SDXL models",
    "first_block": "first-block caching is served for SD 3.x models",
}


class CacheRules(BaseModel):
    """The step cache: a mode the model serves, within the configured limits (a form's JSON text is
    parsed before)."""

    @field_validator("cache", mode="before", check_fields=False)
    @classmethod
    def _an_object_not_text(cls, value: Any) -> Any:
        if isinstance(value, str):
            raise PydanticCustomError(
                "json",
                'cache is an object such as {"mode": "deep", "interval": 3}; in a form, that object as JSON text',
            )
        return value

    @field_validator("cache", check_fields=False)
    @classmethod
    def _cache_served(cls, value: StepCache, info: ValidationInfo) -> StepCache:
        if value.mode == "off":
            return value
        policy = policy_of(info)
        rules = policy.rules
        if info.data.get("controlnets") and "cache" in rules.controlnet_excludes:
            raise controlnets_without("cache", rules.family)
        if not (rules.cache_branches if value.mode == "deep" else rules.first_block_cache):
            served = "deep" if rules.cache_branches else "first_block" if rules.first_block_cache else "none"
            raise PydanticCustomError(
                "cache_unavailable",
                "{what}; this {family} model serves {served}: leave out cache, or send mode off",
                {"what": CACHES_SERVED_BY[value.mode], "family": rules.family, "served": served},
            )
        if value.mode == "first_block":
            if value.threshold > policy.cache.max_threshold:
                raise above_limit(value.threshold, policy.cache.max_threshold, "cache.max_threshold")
            return value
        if value.interval > policy.cache.max_interval:
            raise above_limit(value.interval, policy.cache.max_interval, "cache.max_interval")
        if value.branch >= rules.cache_branches:
            raise PydanticCustomError(
                "cache_branch",
                "cache.branch must be 0..{last} for this model's UNet (3 per down block), got {branch}",
                {"last": rules.cache_branches - 1, "branch": value.branch},
            )
        return value


class SizeConditioningRules(BaseModel):
    """SDXL's size and crop conditioning: on SDXL models only, and only where the job's pipeline reads
    it (declared after ``image``, which decides the pipeline)."""

    @field_validator(*SIZE_CONDITIONING_FIELDS, check_fields=False)
    @classmethod
    def _read_by_the_pipeline(cls, value: list[int] | None, info: ValidationInfo) -> list[int] | None:
        field, rules = str(info.field_name), policy_of(info).rules
        if value is not None and not rules.size_conditioning:
            raise _not_served("size_conditioning_unavailable", SIZE_CONDITIONING, field, rules)
        if "image" not in info.data:  # it failed its own rules: which pipeline is unknown
            return value
        text_to_image = info.data["image"] is None
        if field == "negative_target_size" and text_to_image and "negative_original_size" in info.data:
            original = info.data["negative_original_size"]
            if (original is None) != (value is None):
                raise PydanticCustomError(
                    "negative_size_alone",
                    "StableDiffusionXLPipeline (and its ControlNet pipeline) reads negative_original_size and "
                    "negative_target_size together only (a text-to-image request's unguided rows take the positive "
                    "sizes otherwise): {missing} is missing beside {given}; give both, or neither",
                    {
                        "missing": "negative_target_size" if value is None else "negative_original_size",
                        "given": "negative_original_size" if value is None else "negative_target_size",
                    },
                )
        if field == "negative_crops_coords_top_left" and value is not None:
            if not text_to_image:
                raise PydanticCustomError(
                    "negative_crops_unread",
                    "diffusers' SDXL img2img and inpaint pipelines (and the ControlNet img2img pipeline) condition "
                    "the unguided rows on crops_coords_top_left, not negative_crops_coords_top_left: leave it out "
                    "with an image",
                )
            sizes = [info.data.get(name, ()) for name in ("negative_original_size", "negative_target_size")]
            if None in sizes:  # () where a size failed its own rules: its error says enough
                raise PydanticCustomError(
                    "negative_size_alone",
                    "StableDiffusionXLPipeline reads negative_crops_coords_top_left only with negative_original_size "
                    "and negative_target_size: give both sizes too, or leave it out",
                )
        return value
