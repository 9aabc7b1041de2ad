"""The request schema: defaults, bounds, strictness and the messages clients see."""

import math
import sys
from dataclasses import replace

import pytest

from handler.api.bodies import decode_body, decode_form
from handler.api.errors import RequestError
from handler.api.policy import RequestPolicy
from handler.api.protocol import IncomingRequest, decode
from handler.api.request import FIELD_LABELS, GenerationRequest
from handler.config import (
    CUSTOM_SCHEDULE_FIELDS,
    MAX_SEED,
    SIZE_CONDITIONING_FIELDS,
    SKIP_LAYER_FIELDS,
    FamilyRules,
    RequestDefaults,
    RequestLimits,
    SizeConditioning,
    SkipLayerGuidance,
    StepCache,
)

POLICY = RequestPolicy(
    RequestLimits(
        max_prompt_chars=50, max_inference_steps=30, max_side=512, max_pixels=256 * 512, max_images_per_request=3
    ),
    RequestDefaults(width=64, height=64, num_inference_steps=4),
)


def errors_of(body, content_type="application/json", policy=POLICY):
    with pytest.raises(RequestError) as caught:
        decode_body(body, content_type, policy)
    return [(error.field, error.rule) for error in caught.value.errors], str(caught.value)


def test_defaults_fill_what_the_request_leaves_out():
    request = decode_body({"prompt": "a red circle"}, "application/json", POLICY)
    assert (request.width, request.height, request.num_inference_steps) == (64, 64, 4)
    assert (request.scheduler, request.output_format, request.response_format) == ("ddim", "png", "image")
    assert request.seed is None and request.with_seed().seed is not None


def test_every_field_is_taken_as_sent():
    body = {
        "prompt": "a cat",
        "negative_prompt": "blurry",
        "clip_skip": 2,
        "num_inference_steps": 30,
        "guidance_scale": 1,
        "guidance_rescale": 0.7,
        "seed": MAX_SEED,
        "width": 256,
        "height": 512,
        "num_images_per_prompt": 3,
        "scheduler": "euler_a",
        "output_format": "webp",
        "output_compression": 40,
        "response_format": "json",
        "stream": True,
        "partial_images": 2,
    }
    request = decode_body(body, "application/json", replace(POLICY, streaming=True))
    unset = {"image": None, "mask": None, "strength": None, "loras": [], "controlnets": []}
    unset |= dict.fromkeys(
        [
            "prompt_2",
            "negative_prompt_2",
            "prompt_3",
            "negative_prompt_3",
            *SKIP_LAYER_FIELDS,
            *SIZE_CONDITIONING_FIELDS,
            *CUSTOM_SCHEDULE_FIELDS,
        ]
    )
    unset["cache"], unset["eta"] = StepCache().model_dump(), 0.0
    assert request.model_dump() == {**body, "guidance_scale": 1.0, **unset}


def test_stream_is_a_rule_of_the_engine_not_of_the_client():
    with pytest.raises(RequestError) as error:
        decode_body({"prompt": "a cat", "stream": True}, "application/json", POLICY)
    (item,) = error.value.errors
    assert item.field == "stream" and item.rule == "streaming_unavailable" and "continuousBatching" in item.message
    assert not decode_body({"prompt": "a cat", "stream": False}, "application/json", POLICY).stream


@pytest.mark.parametrize(
    ("body", "field", "rule"),
    [
        ({}, "prompt", "missing"),
        ({"prompt": ""}, "prompt", "non_blank"),
        ({"prompt": " \n\t"}, "prompt", "non_blank"),
        ({"prompt": "x" * 51}, "prompt", "string_too_long"),
        ({"prompt": "x", "negative_prompt": "y" * 51}, "negative_prompt", "string_too_long"),
        ({"prompt": 5}, "prompt", "string_type"),
        ({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps", "greater_than_equal"),
        ({"prompt": "x", "num_inference_steps": 31}, "num_inference_steps", "less_than_equal"),
        ({"prompt": "x", "num_inference_steps": "4"}, "num_inference_steps", "int_type"),
        ({"prompt": "x", "num_inference_steps": True}, "num_inference_steps", "int_type"),
        ({"prompt": "x", "num_inference_steps": 4.5}, "num_inference_steps", "int_type"),
        ({"prompt": "x", "guidance_scale": math.nan}, "guidance_scale", "finite_number"),
        ({"prompt": "x", "guidance_scale": math.inf}, "guidance_scale", "finite_number"),
        ({"prompt": "x", "guidance_scale": -1}, "guidance_scale", "greater_than_equal"),
        ({"prompt": "x", "guidance_scale": 31}, "guidance_scale", "less_than_equal"),
        ({"prompt": "x", "seed": -1}, "seed", "greater_than_equal"),
        ({"prompt": "x", "seed": MAX_SEED + 1}, "seed", "less_than_equal"),
        ({"prompt": "x", "seed": 1.5}, "seed", "int_type"),
        ({"prompt": "x", "width": 100}, "width", "multiple_of"),
        ({"prompt": "x", "height": 36}, "height", "multiple_of"),
        ({"prompt": "x", "width": 56}, "width", "greater_than_equal"),
        ({"prompt": "x", "width": 520}, "width", "less_than_equal"),
        ({"prompt": "x", "width": 512, "height": 512}, "height", "pixel_budget"),
        ({"prompt": "x", "num_images_per_prompt": 0}, "num_images_per_prompt", "greater_than_equal"),
        ({"prompt": "x", "num_images_per_prompt": 4}, "num_images_per_prompt", "less_than_equal"),
        ({"prompt": "x", "scheduler": "lcm"}, "scheduler", "literal_error"),
        ({"prompt": "x", "output_format": "gif"}, "output_format", "literal_error"),
        ({"prompt": "x", "response_format": "base64"}, "response_format", "literal_error"),
        ({"prompt": "x", "guidance_rescale": -0.1}, "guidance_rescale", "greater_than_equal"),
        ({"prompt": "x", "guidance_rescale": 1.5}, "guidance_rescale", "less_than_equal"),
        ({"prompt": "x", "guidance_rescale": math.nan}, "guidance_rescale", "finite_number"),
        ({"prompt": "x", "clip_skip": -1}, "clip_skip", "greater_than_equal"),
        ({"prompt": "x", "clip_skip": 12}, "clip_skip", "less_than_equal"),
        ({"prompt": "x", "clip_skip": "1"}, "clip_skip", "int_type"),
        ({"prompt": "x", "steps": 4}, "steps", "unknown_field"),
        ({"prompt": "x", "extra": {"nested": [1]}}, "extra", "unknown_field"),
    ],
)
def test_each_broken_rule_names_its_field(body, field, rule):
    errors, _ = errors_of(body)
    assert errors == [(field, rule)]


def test_messages_say_what_was_given_and_what_is_allowed():
    _, message = errors_of({"prompt": "x", "width": 100})
    assert "multiple of 8" in message and "100" in message
    _, message = errors_of({"prompt": "x", "num_inference_steps": 31})
    assert "30" in message and "max_inference_steps" in message and "31" in message
    _, message = errors_of({"prompt": "x", "width": 512, "height": 512})
    assert "262144" in message and "131072" in message
    _, message = errors_of({"prompt": "x", "steps": 4})
    assert "'steps'" in message and "num_inference_steps" in message


def test_all_broken_fields_are_reported_together():
    errors, _ = errors_of({"prompt": "", "width": 100, "scheduler": "lcm"})
    assert {field for field, _ in errors} == {"prompt", "width", "scheduler"}


@pytest.mark.parametrize(
    ("body", "rule", "words"),
    [
        (bytearray(), "required", "empty"),
        (bytearray(b"  \n"), "required", "empty"),
        (bytearray(b'{"prompt": '), "json", "not valid JSON"),
        (bytearray(b"\xff\xfe\x00"), "utf8", "UTF-8"),
        (bytearray(b"[" * 100000 + b"]" * 100000), "json", "nested too deeply"),
        ([{"prompt": "x"}], "object", "array"),
        ("a cat", "object", "string"),
        (42, "object", "number"),
        (None, "object", "null"),
    ],
)
def test_bodies_that_are_not_a_json_object(body, rule, words):
    errors, message = errors_of(body)
    assert errors == [("body", rule)]
    assert words in message


def test_raw_json_bytes_are_parsed():
    assert decode_body(bytearray(b'{"prompt": "x", "seed": 3}'), "application/octet-stream", POLICY).seed == 3


def test_text_body_is_the_prompt():
    request = decode_body("a blue square", "text/plain; charset=utf-8", POLICY)
    assert request.prompt == "a blue square" and request.num_inference_steps == 4
    assert decode_body(bytearray("un carré bleu".encode()), "text/plain", POLICY).prompt == "un carré bleu"
    errors, _ = errors_of(bytearray(b"\xff"), "text/plain")
    assert errors == [("body", "utf8")]


@pytest.mark.parametrize("content_type", [None, "", " "])
def test_a_body_without_content_type_is_json_when_it_looks_like_json_else_the_prompt(content_type):
    """As TorchServe's diffusers example (``curl -T``, ``requests.post(url, data=prompt)``) and gRPC
    clients send it; a mistyped JSON object gets its 400, not an image of its text."""
    assert decode_body(bytearray(b"a red circle"), content_type, POLICY).prompt == "a red circle"
    assert decode_body(bytearray(b'"quoted" 42'), content_type, POLICY).prompt == '"quoted" 42'
    assert errors_of(bytearray(b'{"prompt": "a cat", "width": 64'), content_type)[0] == [("body", "json")]
    assert errors_of(bytearray(b'  [{"prompt": "a cat"},]'), content_type)[0] == [("body", "json")]
    request = decode_body(bytearray(b'{"prompt": "x", "seed": 3}'), content_type, POLICY)
    assert (request.prompt, request.seed) == ("x", 3)
    assert errors_of(bytearray(b"[1, 2]"), content_type)[0] == [("body", "object")]
    assert errors_of(bytearray(b"\xff\xfe"), content_type)[0] == [("body", "utf8")]
    assert errors_of(bytearray(b"x" * 51), content_type)[0] == [("prompt", "string_too_long")]
    assert errors_of(bytearray(b"  "), content_type)[0] == [("body", "required")]


def test_a_non_json_body_with_a_json_content_type_is_refused_naming_json():
    assert errors_of(bytearray(b"a red circle"), "application/json")[0] == [("body", "json")]


def test_what_fuzzing_found_is_refused_by_name():
    """Found while writing test_request_fuzz.py: the first three were 500s; the last put client text into logs
    and metric labels (TorchServe's metrics travel as log lines split on newlines, commas, colons)."""
    # JSON's "\ud800" escape: a lone surrogate, which the tokenizer refuses with a TypeError
    assert errors_of({"prompt": "a\ud800"})[0] == [("prompt", "string_unicode")]
    assert errors_of({"prompt": "x", "negative_prompt": "\udfff"})[0] == [("negative_prompt", "string_unicode")]
    # json.loads raises a plain ValueError for an integer of more than 4300 digits
    assert errors_of(bytearray(b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}"))[0] == [("body", "json")]
    # a value nested about as deeply as json.loads allows: repr() of it in the message recursed too deep
    deep: list = []
    for _ in range(sys.getrecursionlimit()):
        deep = [deep]
    assert errors_of({"prompt": deep})[0] == [("prompt", "string_type")]
    with pytest.raises(RequestError) as caught:
        decode_body({"prompt": "x", "a\n[METRICS]b": 1}, "application/json", POLICY)
    labels = [(error.field, error.label(FIELD_LABELS)) for error in caught.value.errors]
    assert labels == [("a\n[METRICS]b", "unknown_field")]


def test_form_fields_are_converted_from_text():
    request = decode_form({"prompt": bytearray(b"a cat"), "num_inference_steps": "7", "guidance_scale": "2.5"}, POLICY)
    assert (request.prompt, request.num_inference_steps, request.guidance_scale) == ("a cat", 7, 2.5)
    with pytest.raises(RequestError) as caught:
        decode_form({"prompt": "a cat", "num_inference_steps": "many"}, POLICY)
    assert caught.value.errors[0].field == "num_inference_steps"


def test_each_image_has_its_own_reproducible_seed():
    request = decode_body({"prompt": "x", "seed": 10, "num_images_per_prompt": 3}, "application/json", POLICY)
    assert request.image_seeds() == [10, 11, 12]
    wrapped = decode_body({"prompt": "x", "seed": MAX_SEED, "num_images_per_prompt": 2}, "application/json", POLICY)
    assert wrapped.image_seeds() == [MAX_SEED, 0]
    drawn = {
        GenerationRequest.model_validate({**request.model_dump(), "seed": None}, context=POLICY).with_seed().seed
        for _ in range(5)
    }
    assert len(drawn) > 1 and all(0 <= seed <= MAX_SEED for seed in drawn)


def test_reported_parameters_are_the_effective_ones():
    settings = {"prompt": "x", "seed": 1, "clip_skip": 1, "guidance_rescale": 0.7}
    reported = decode_body(settings, "application/json", POLICY).parameters()
    assert {name: reported[name] for name in settings} == settings
    unguided = decode_body({**settings, "guidance_scale": 1}, "application/json", POLICY).parameters()
    assert "guidance_rescale" not in unguided, "diffusers ignores it without guidance"
    request = decode_body({"prompt": "x", "seed": 1}, "application/json", POLICY)
    assert request.parameters() == {
        "prompt": "x",
        "negative_prompt": None,
        "num_inference_steps": 4,
        "guidance_scale": 7.5,
        "seed": 1,
        "width": 64,
        "height": 64,
        "num_images_per_prompt": 1,
        "scheduler": "ddim",
    }


def test_grpc_requests_are_served_in_both_modes_but_cannot_stream():
    body = bytearray(b"a red circle")
    for policy in (POLICY, replace(POLICY, streaming=True)):
        assert decode(IncomingRequest(body, over_grpc=True), policy).prompt == "a red circle"
        with pytest.raises(RequestError) as caught:
            decode(IncomingRequest({"prompt": "x", "stream": True}, "application/json", over_grpc=True), policy)
        (error,) = caught.value.errors
        assert (error.field, error.rule) == ("stream", "streaming_unavailable") and "over HTTP only" in error.message
    streamed = decode(
        IncomingRequest({"prompt": "x", "stream": True}, "application/json"), replace(POLICY, streaming=True)
    )
    assert streamed.stream


def test_loras_are_named_and_scaled_within_the_limits():
    request = decode_body(
        {"prompt": "p", "loras": [{"name": "outline", "scale": 0.5}, {"name": "purple"}]}, "application/json", POLICY
    )
    assert [(lora.name, lora.scale) for lora in request.loras] == [("outline", 0.5), ("purple", 1.0)]
    assert request.parameters()["loras"] == [{"name": "outline", "scale": 0.5}, {"name": "purple", "scale": 1.0}]
    assert "loras" not in decode_body({"prompt": "p"}, "application/json", POLICY).parameters()
    form = decode_form({"prompt": "p", "loras": '[{"name": "outline", "scale": 0.25}]'}, POLICY)
    assert form.loras[0].scale == 0.25


@pytest.mark.parametrize(
    ("loras", "field", "rule"),
    [
        ([{"name": "../outline"}], "loras.0.name", "lora_name"),
        ([{"name": "/etc/passwd"}], "loras.0.name", "lora_name"),
        ([{"name": "a/b"}], "loras.0.name", "lora_name"),
        ([{"name": "outline", "scale": float("nan")}], "loras.0.scale", "finite_number"),
        ([{"name": "outline", "scale": 100}], "loras.0.scale", "lora_scale"),
        ([{"name": "outline", "weight": 1}], "loras.0.weight", "unknown_field"),
        ([{"name": "outline"}, {"name": "outline"}], "loras", "lora_repeated"),
        ([{"name": f"l{index}"} for index in range(5)], "loras", "too_long"),
        ("outline", "loras", "json"),
        (7, "loras", "list_type"),
    ],
)
def test_bad_loras_are_refused_by_field_and_rule(loras, field, rule):
    with pytest.raises(RequestError) as caught:
        decode_body({"prompt": "p", "loras": loras}, "application/json", POLICY)
    assert [(error.field, error.rule) for error in caught.value.errors] == [(field, rule)]
    assert caught.value.errors[0].label(FIELD_LABELS) == "loras"


JSON = "application/json"
SD3_POLICY = replace(
    POLICY,
    defaults=RequestDefaults(width=64, height=64, scheduler="flow_match_euler"),
    rules=FamilyRules(
        "SD 3.x",
        ("flow_match_euler",),
        "flow_match_euler",
        16,
        "start",
        max_side=256,
        max_clip_skip=10,
        guidance_rescale=False,
        text_encoders=3,
        transformer_blocks=24,
        custom_schedules=(("flow_match_euler", ("sigmas",)),),
        eta_schedulers=(),
        controlnet_excludes=("image", "skip_guidance_layers", "cache"),
    ),
)
SDXL_POLICY = replace(
    POLICY,
    rules=FamilyRules("SDXL", max_clip_skip=10, text_encoders=2, zeros_without_negative=True, size_conditioning=True),
)


def test_the_familys_rules_name_what_it_allows():
    fields, message = errors_of({"prompt": "x", "scheduler": "ddim"}, policy=SD3_POLICY)
    assert fields == [("scheduler", "literal_error")]
    assert "'flow_match_euler' (the schedulers of SD 3.x models)" in message and "'euler'" not in message
    fields, message = errors_of({"prompt": "x", "scheduler": "flow_match_euler"})
    assert fields == [("scheduler", "literal_error")]
    allowed = (
        "'ddim', 'euler', 'euler_a', 'lms', 'lms_karras', 'heun', 'dpm2', 'dpm2_karras', 'dpm2_a', "
        "'dpm2_a_karras', 'dpmpp_2m', 'dpmpp_2m_karras', 'dpmpp_2m_sde', 'dpmpp_2m_sde_karras', 'unipc' or 'pndm'"
    )
    assert f"{allowed} (the schedulers of SD 1.x models)" in message
    fields, message = errors_of({"prompt": "x", "width": 72, "height": 320}, policy=SD3_POLICY)
    assert fields == [("width", "multiple_of"), ("height", "less_than_equal")]
    assert "multiple of 16 for SD 3.x models (given: 72)" in message and "largest side this SD 3.x model" in message
    assert decode_body({"prompt": "x", "width": 72}, "application/json", POLICY).width == 72
    fields, message = errors_of({"prompt": "x", "clip_skip": 11, "scheduler": "flow_match_euler"}, policy=SD3_POLICY)
    assert fields == [("clip_skip", "less_than_equal")]
    assert "less than or equal to 10 (the most layers this SD 3.x model's CLIP text encoders can skip" in message
    body = {"prompt": "x", "guidance_rescale": 0.7, "scheduler": "flow_match_euler"}
    fields, message = errors_of(body, policy=SD3_POLICY)
    assert fields == [("guidance_rescale", "guidance_rescale_unavailable")] and "SD 3.x model" in message


def test_each_text_encoders_prompts_are_taken_where_the_model_is_served_with_that_encoder():
    sdxl = {"prompt": "x", "negative_prompt": "", "prompt_2": "y", "negative_prompt_2": "z"}
    request = decode_body(sdxl, JSON, SDXL_POLICY)
    assert {name: request.parameters()[name] for name in sdxl} == sdxl
    assert (
        "prompt_3" not in request.parameters()
        and "prompt_2" not in decode_body({"prompt": "x"}, JSON, POLICY).parameters()
    )
    sd3 = {
        "prompt": "x",
        "negative_prompt_2": "y",
        "prompt_3": "z",
        "negative_prompt_3": "",
        "scheduler": "flow_match_euler",
    }
    assert decode_body(sd3, JSON, SD3_POLICY).negative_prompt_2 == "y", "SD 3 has no zero negative prompt"
    assert decode_body({"prompt": "x", "negative_prompt_2": ""}, JSON, SDXL_POLICY).negative_prompt_2 == ""

    fields, message = errors_of({"prompt": "x", "prompt_2": "y", "negative_prompt_3": ""})
    assert fields == [("prompt_2", "prompt_unavailable"), ("negative_prompt_3", "prompt_unavailable")]
    assert "prompt_2 is for a second text encoder (CLIP-G), which this SD 1.x model is served without" in message
    fields, message = errors_of({"prompt": "x", "prompt_3": "y"}, policy=SDXL_POLICY)
    assert (
        fields == [("prompt_3", "prompt_unavailable")] and "a third text encoder (T5), which this SDXL model" in message
    )
    fields, message = errors_of({"prompt": "x", "negative_prompt_2": "y"}, policy=SDXL_POLICY)
    assert fields == [("negative_prompt_2", "negative_prompt_missing")]
    assert "without one this SDXL model's unguided rows are zeros" in message and "give negative_prompt too" in message
    fields, message = errors_of(
        {"prompt": "x", "negative_prompt": "", "prompt_2": "y" * 51, "negative_prompt_2": "\ud800"}, policy=SDXL_POLICY
    )
    assert fields == [("prompt_2", "string_too_long"), ("negative_prompt_2", "string_unicode")]


def test_skip_layer_guidance_is_taken_with_diffusers_defaults_and_reported():
    request = decode_body({"prompt": "x", "skip_guidance_layers": [9, 7, 8, 7]}, "application/json", SD3_POLICY)
    assert request.skip_layer_guidance() == SkipLayerGuidance((7, 8, 9), 2.8, 0.01, 0.2)
    reported = request.parameters()
    assert {name: reported[name] for name in SKIP_LAYER_FIELDS} == {
        "skip_guidance_layers": [7, 8, 9],
        "skip_layer_guidance_scale": 2.8,
        "skip_layer_guidance_start": 0.01,
        "skip_layer_guidance_stop": 0.2,
    }
    given = {"skip_guidance_layers": [0, 23], "skip_layer_guidance_scale": 3, "skip_layer_guidance_stop": 1}
    request = decode_body({"prompt": "x", **given}, "application/json", SD3_POLICY)
    assert request.skip_layer_guidance() == SkipLayerGuidance((0, 23), 3.0, 0.01, 1.0)
    plain = decode_body({"prompt": "x"}, "application/json", SD3_POLICY)
    assert plain.skip_layer_guidance() is None and not set(SKIP_LAYER_FIELDS) & set(plain.parameters())
    form = decode_form({"prompt": "x", "skip_guidance_layers": "[7, 8]", "skip_layer_guidance_scale": "2"}, SD3_POLICY)
    assert form.skip_layer_guidance() == SkipLayerGuidance((7, 8), 2.0)


def test_an_operators_default_skip_layer_guidance_acts_on_guided_requests_that_leave_it_out():
    """handler.defaults.skip_guidance_layers (an SD 3.5 Medium deployment's [7, 8, 9]): a guided request
    without the field gets it with diffusers' settings, or with its own; an unguided one gets none (it
    is not refused); one that sends null or its own blocks has what it sent."""
    policy = replace(SD3_POLICY, defaults=SD3_POLICY.defaults.model_copy(update={"skip_guidance_layers": [7, 8, 9]}))
    assert decode_body({"prompt": "x"}, JSON, policy).skip_layer_guidance() == SkipLayerGuidance((7, 8, 9))
    request = decode_body({"prompt": "x", "skip_layer_guidance_scale": 2}, JSON, policy)
    assert request.skip_layer_guidance() == SkipLayerGuidance((7, 8, 9), 2.0)
    assert request.parameters()["skip_guidance_layers"] == [7, 8, 9]
    for unguided in ({"guidance_scale": 1}, {"guidance_scale": 0.0}):
        request = decode_body({"prompt": "x", **unguided}, JSON, policy)
        assert request.skip_layer_guidance() is None and "skip_guidance_layers" not in request.parameters()
    assert decode_form({"prompt": "x", "guidance_scale": "1"}, policy).skip_layer_guidance() is None
    assert decode_form({"prompt": "x", "guidance_scale": "5"}, policy).skip_layer_guidance() is not None
    assert decode_body({"prompt": "x", "skip_guidance_layers": None}, JSON, policy).skip_layer_guidance() is None
    assert decode_body({"prompt": "x", "skip_guidance_layers": [3]}, JSON, policy).skip_layer_guidance() == (
        SkipLayerGuidance((3,))
    )
    unguided_by_default = replace(policy, defaults=policy.defaults.model_copy(update={"guidance_scale": 1.0}))
    assert decode_body({"prompt": "x"}, JSON, unguided_by_default).skip_layer_guidance() is None
    request = decode_body({"prompt": "x", "guidance_scale": 4}, JSON, unguided_by_default)
    assert request.skip_layer_guidance() == SkipLayerGuidance((7, 8, 9))
    # what the request sends is checked as before: an unguided request naming the settings is refused
    for settings_policy in (policy, SD3_POLICY):
        fields, message = errors_of(
            {"prompt": "x", "guidance_scale": 1, "skip_layer_guidance_scale": 3}, policy=settings_policy
        )
        assert fields == [("skip_layer_guidance_scale", "guidance_needed")]
        assert "guidance_scale above 1, or leave skip_layer_guidance_scale out" in message
    for bad in ("many", 10**400):  # that field alone (the fuzz found the integer too large for a float)
        assert errors_of({"prompt": "x", "guidance_scale": bad}, policy=policy)[0][0][0] == "guidance_scale"


def test_skip_layer_guidance_is_refused_naming_the_field_where_diffusers_would_not_apply_it():
    fields, message = errors_of({"prompt": "x", "skip_guidance_layers": [7]})
    assert fields == [("skip_guidance_layers", "skip_layer_guidance_unavailable")]
    assert "served for SD 3.x models" in message and "this is an SD 1.x model" in message
    fields, message = errors_of({"prompt": "x", "skip_guidance_layers": [7], "guidance_scale": 1}, policy=SD3_POLICY)
    assert fields == [("skip_guidance_layers", "guidance_needed")] and "guidance_scale above 1" in message
    fields, message = errors_of({"prompt": "x", "skip_guidance_layers": [7, 24, 30]}, policy=SD3_POLICY)
    assert fields == [("skip_guidance_layers", "block_out_of_range")]
    assert "names [24, 30]: this SD 3.x model's transformer has 24 blocks, 0 to 23" in message
    assert errors_of({"prompt": "x", "skip_guidance_layers": []}, policy=SD3_POLICY)[0] == [
        ("skip_guidance_layers", "too_short")
    ]
    assert (
        errors_of({"prompt": "x", "skip_guidance_layers": [-1]}, policy=SD3_POLICY)[0][0][0] == "skip_guidance_layers.0"
    )
    fields, message = errors_of({"prompt": "x", "skip_guidance_layers": "7,8"}, policy=SD3_POLICY)
    assert fields == [("skip_guidance_layers", "json")] and "[7, 8, 9]" in message
    fields, message = errors_of({"prompt": "x", "skip_layer_guidance_scale": 3})
    assert fields == [("skip_layer_guidance_scale", "skip_layer_guidance_unavailable")]
    assert "served for SD 3.x models" in message and "leave skip_layer_guidance_scale out" in message
    fields, message = errors_of({"prompt": "x", "skip_guidance_layers": [7] * 25}, policy=SD3_POLICY)
    assert fields == [("skip_guidance_layers", "too_long")] and "lists 25 blocks" in message
    fields, message = errors_of({"prompt": "x", "skip_layer_guidance_scale": 3}, policy=SD3_POLICY)
    assert fields == [("skip_layer_guidance_scale", "skip_guidance_layers_missing")]
    assert "give the blocks" in message
    layers = {"prompt": "x", "skip_guidance_layers": [7]}
    fields, message = errors_of(
        {**layers, "skip_layer_guidance_start": 0.5, "skip_layer_guidance_stop": 0.2}, policy=SD3_POLICY
    )
    assert fields == [("skip_layer_guidance_stop", "stop_before_start")]
    fields, message = errors_of({**layers, "skip_layer_guidance_start": 0.5}, policy=SD3_POLICY)
    assert fields == [("skip_layer_guidance_stop", "stop_before_start")]
    assert "skip_layer_guidance_stop (0.2, its default where left out) must be above" in message
    fields, message = errors_of({**layers, "skip_layer_guidance_scale": 31}, policy=SD3_POLICY)
    assert fields == [("skip_layer_guidance_scale", "less_than_equal")] and "max_guidance_scale" in message
    for field, value in [
        ("skip_layer_guidance_start", 1.5),
        ("skip_layer_guidance_scale", -1),
        ("skip_layer_guidance_stop", "nan"),
    ]:
        assert errors_of({**layers, field: value}, policy=SD3_POLICY)[0][0][0] == field


def test_a_custom_schedule_runs_its_own_steps_and_is_reported():
    """diffusers' ``timesteps`` or ``sigmas``: the steps follow them (Euler's sigmas end with the
    final sigma, flow matching's do not); from a form, as JSON text."""
    request = decode_body({"prompt": "x", "scheduler": "euler", "timesteps": [999, 500, 20]}, JSON, POLICY)
    assert request.num_inference_steps == 3
    reported = request.parameters()
    assert reported["timesteps"] == [999, 500, 20] and reported["num_inference_steps"] == 3
    assert "sigmas" not in reported
    request = decode_body({"prompt": "x", "scheduler": "euler", "sigmas": [14.6, 2, 0]}, JSON, POLICY)
    assert (request.num_inference_steps, request.sigmas) == (2, [14.6, 2.0, 0.0])
    given = {"prompt": "x", "scheduler": "dpmpp_2m", "timesteps": [999, 1], "num_inference_steps": 2}
    assert decode_body(given, JSON, POLICY).timesteps == [999, 1]
    request = decode_body({"prompt": "x", "sigmas": [1, 0.5, 0.25]}, JSON, SD3_POLICY)
    assert (request.num_inference_steps, request.parameters()["sigmas"]) == (3, [1.0, 0.5, 0.25])
    ays = [14.615, 6.475, 3.861, 2.697, 1.886, 1.396, 0.963, 0.652, 0.399, 0.152, 0.0]  # AysSchedules' SD sigmas
    assert decode_body({"prompt": "x", "scheduler": "euler", "sigmas": ays}, JSON, POLICY).num_inference_steps == 10
    form = decode_form({"prompt": "x", "scheduler": "euler", "timesteps": "[999, 500]"}, POLICY)
    assert (form.timesteps, form.num_inference_steps) == ([999, 500], 2)
    plain = decode_body({"prompt": "x"}, JSON, POLICY)
    assert not set(CUSTOM_SCHEDULE_FIELDS) & set(plain.parameters())


@pytest.mark.parametrize(
    ("body", "policy", "field", "rule", "words"),
    [
        (
            {"timesteps": [999, 500]},
            POLICY,
            "timesteps",
            "custom_schedule_unavailable",
            "scheduler ddim takes no custom timesteps on this SD 1.x model (diffusers' set_timesteps); euler or "
            "heun or dpmpp_2m or dpmpp_2m_sde does: name it, or leave timesteps out",
        ),
        ({"scheduler": "dpmpp_2m", "sigmas": [2, 0]}, POLICY, "sigmas", "custom_schedule_unavailable", "euler does"),
        (
            {"scheduler": "euler", "timesteps": [900, 500, 500]},
            POLICY,
            "timesteps",
            "schedule_not_decreasing",
            "timesteps must decrease strictly, from the noisiest step: entry 2 (500) is not below the one before "
            "it (500)",
        ),
        (
            {"scheduler": "euler", "timesteps": [1000, 500]},
            POLICY,
            "timesteps",
            "schedule_out_of_range",
            "timesteps entry 0 is 1000: this model's timesteps run from 999 (the noisiest) to 0",
        ),
        ({"scheduler": "euler", "sigmas": [2]}, POLICY, "sigmas", "too_short", "give at least 2, for one step"),
        ({"scheduler": "euler", "sigmas": [2, 3, 0]}, POLICY, "sigmas", "schedule_not_decreasing", "entry 1 (3.0)"),
        (
            {"scheduler": "euler", "sigmas": [2, -1]},
            POLICY,
            "sigmas.1",
            "greater_than_equal",
            "greater than or equal to 0",
        ),
        (
            {"sigmas": [1.5, 0.5]},
            SD3_POLICY,
            "sigmas",
            "schedule_out_of_range",
            "sigmas entry 0 is 1.5: flow matching's sigmas are above 0 and at most 1 (the noisiest)",
        ),
        ({"sigmas": [0.5, 0]}, SD3_POLICY, "sigmas", "schedule_out_of_range", "sigmas entry 1 is 0.0"),
        (
            {"timesteps": [999]},
            SD3_POLICY,
            "timesteps",
            "custom_schedule_unavailable",
            "on this SD 3.x model (diffusers' set_timesteps); nor do its others: leave timesteps out",
        ),
        (
            {"scheduler": "euler", "timesteps": [999, 1], "sigmas": [2, 0]},
            POLICY,
            "sigmas",
            "timesteps_and_sigmas",
            "give timesteps or sigmas, not both",
        ),
        (
            {"scheduler": "euler", "timesteps": [999, 1], "num_inference_steps": 4},
            POLICY,
            "timesteps",
            "steps_mismatch",
            "these 2 timesteps run 2 steps, but num_inference_steps is 4: leave num_inference_steps out (it follows "
            "timesteps) or make it 2",
        ),
        ({"scheduler": "euler", "timesteps": []}, POLICY, "timesteps", "too_short", "at least 1 item"),
        ({"scheduler": "euler", "timesteps": "[999]"}, POLICY, "timesteps", "json", "a list such as [999, 845"),
        ({"scheduler": "euler", "timesteps": [999.5]}, POLICY, "timesteps.0", "int_type", "valid integer"),
        (
            {"scheduler": "euler", "timesteps": list(range(999, 959, -1))},
            POLICY,
            "timesteps",
            "too_long",
            "these 40 timesteps run 40 steps, more than the 30 a request may run here",
        ),
        ({"scheduler": "euler", "sigmas": [1e300, 0]}, POLICY, "sigmas", "schedule_out_of_range", "entry 0 is inf"),
        (
            {"scheduler": "euler", "sigmas": [2, 1e-300, 0]},  # float32 reads 1e-300 as 0: a division by 0
            POLICY,
            "sigmas",
            "schedule_out_of_range",
            "sigmas entry 1 is 0.0: Euler's sigmas are above 0 (the last, the final sigma, may be 0)",
        ),
        (
            {"scheduler": "euler", "sigmas": [20, 15, 5, 0]},
            POLICY,
            "sigmas",
            "schedule_out_of_range",
            "entry 1 is 15.0: Euler's sigmas are above 0 (the last, the final sigma, may be 0); the first at most "
            "1000, the others below this model's largest, 14.6146 (two at or above it would both run at its last "
            "timestep)",
        ),
        ({"scheduler": ["euler"], "sigmas": [2, 0]}, POLICY, "scheduler", "literal_error", "'euler'"),
        ({"scheduler": "euler", "timesteps": [9, "x"], "sigmas": [3, 0]}, POLICY, "timesteps.1", "int_type", "integer"),
    ],
)
def test_a_custom_schedule_is_refused_naming_the_field_where_its_scheduler_would_not_take_it(
    body, policy, field, rule, words
):
    fields, message = errors_of({"prompt": "x", **body}, policy=policy)
    assert fields == [(field, rule)] and words in message


def test_ddims_eta_is_taken_and_reported_where_the_scheduler_takes_it_and_refused_by_name_elsewhere():
    request = decode_body({"prompt": "x", "eta": 0.5}, JSON, POLICY)
    assert request.eta == 0.5 and request.parameters()["eta"] == 0.5
    plain = decode_body({"prompt": "x", "scheduler": "euler", "eta": 0}, JSON, POLICY)
    assert plain.eta == 0 and "eta" not in plain.parameters()
    assert decode_form({"prompt": "x", "eta": "1"}, POLICY).eta == 1.0
    fields, message = errors_of({"prompt": "x", "scheduler": "euler_a", "eta": 0.5})
    assert fields == [("eta", "eta_unavailable")]
    assert "scheduler euler_a on this SD 1.x model takes none; ddim does: name it, or leave eta out" in message
    fields, message = errors_of({"prompt": "x", "eta": 0.5}, policy=SD3_POLICY)
    assert fields == [("eta", "eta_unavailable")] and "takes none; nor do its others: leave eta out" in message
    assert errors_of({"prompt": "x", "eta": 1.5})[0] == [("eta", "less_than_equal")]


def test_sdxl_sizes_and_crops_are_taken_as_pairs_and_reported():
    sizes = {"original_size": [2048, 1536], "crops_coords_top_left": [0, 64], "target_size": [1024, 1024]}
    request = decode_body({"prompt": "x", **sizes}, "application/json", SDXL_POLICY)
    assert request.size_conditioning() == SizeConditioning((2048, 1536), (0, 64), (1024, 1024))
    assert {name: request.parameters()[name] for name in sizes} == sizes
    negatives = {"negative_original_size": [512, 512], "negative_target_size": [1024, 1024]}
    request = decode_body(
        {"prompt": "x", **negatives, "negative_crops_coords_top_left": [8, 8]}, "application/json", SDXL_POLICY
    )
    assert request.size_conditioning() == SizeConditioning(
        negative_original_size=(512, 512), negative_target_size=(1024, 1024), negative_crops_coords_top_left=(8, 8)
    )
    plain = decode_body({"prompt": "x"}, "application/json", SDXL_POLICY)
    assert plain.size_conditioning() is None and not set(SIZE_CONDITIONING_FIELDS) & set(plain.parameters())
    unguided = decode_body({"prompt": "x", "guidance_scale": 1, **negatives}, "application/json", SDXL_POLICY)
    assert not set(negatives) & set(unguided.parameters()), "no unguided rows read them"
    form = decode_form({"prompt": "x", "original_size": "[512, 256]"}, SDXL_POLICY)
    assert form.size_conditioning() == SizeConditioning(original_size=(512, 256))


def test_sdxl_sizes_and_crops_a_pipeline_would_not_read_are_refused_naming_the_field():
    fields, message = errors_of({"prompt": "x", "target_size": [64, 64]})
    assert fields == [("target_size", "size_conditioning_unavailable")]
    assert (
        "size and crop conditioning is SDXL's" in message
        and "this is an SD 1.x model: leave target_size out" in message
    )
    fields, message = errors_of({"prompt": "x", "negative_original_size": [64, 64]}, policy=SDXL_POLICY)
    assert fields == [("negative_target_size", "negative_size_alone")]
    assert "negative_target_size is missing beside negative_original_size" in message
    fields, message = errors_of({"prompt": "x", "negative_target_size": [64, 64]}, policy=SDXL_POLICY)
    assert fields == [("negative_target_size", "negative_size_alone")]
    assert "negative_original_size is missing beside negative_target_size" in message
    broken = {
        "negative_original_size": [64],
        "negative_target_size": [64, 64],
        "negative_crops_coords_top_left": [0, 0],
    }
    assert errors_of({"prompt": "x", **broken}, policy=SDXL_POLICY)[0] == [("negative_original_size", "too_short")]
    fields, _ = errors_of({"prompt": "x", "negative_crops_coords_top_left": [0, 8]}, policy=SDXL_POLICY)
    assert fields == [("negative_crops_coords_top_left", "negative_size_alone")]
    image = {"prompt": "x", "image": _b64(_png(_photo(64, 64)))}
    assert decode_body({**image, "negative_original_size": [64, 64]}, "application/json", SDXL_POLICY)
    fields, message = errors_of({**image, "negative_crops_coords_top_left": [0, 8]}, policy=SDXL_POLICY)
    assert fields == [("negative_crops_coords_top_left", "negative_crops_unread")] and "img2img" in message
    for value, rule in [([64], "too_short"), ([64, 64, 64], "too_long"), ("64x64", "json")]:
        assert errors_of({"prompt": "x", "original_size": value}, policy=SDXL_POLICY)[0] == [("original_size", rule)]
    assert errors_of({"prompt": "x", "crops_coords_top_left": [-1, 0]}, policy=SDXL_POLICY)[0][0][0] == (
        "crops_coords_top_left.0"
    )


def test_more_steps_than_the_models_training_timesteps_are_refused_naming_the_field():
    """A UNet's schedule samples its training timesteps (DDIM fails from 1000 of them): with limits
    that allow more, the family's rule refuses them as a 400, not a failed start."""
    policy = replace(POLICY, limits=RequestLimits(max_inference_steps=5000), rules=replace(POLICY.rules, max_steps=998))
    fields, message = errors_of({"prompt": "x", "num_inference_steps": 999}, policy=policy)
    assert fields == [("num_inference_steps", "less_than_equal")]
    assert "998 (the most steps this SD 1.x model's schedules take), got 999" in message
    assert decode_body({"prompt": "x", "num_inference_steps": 998}, "application/json", policy).num_inference_steps
    assert errors_of({"prompt": "x", "num_inference_steps": 31})[0] == [("num_inference_steps", "less_than_equal")]


def _png(pixels) -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode("ascii")


def _photo(width=96, height=80):
    """A picture with a sharp square in it (edges for Canny)."""
    import numpy as np

    pixels = np.zeros((height, width, 3), dtype=np.uint8)
    pixels[20:60, 30:70] = (200, 120, 40)
    return pixels


def test_controlnets_take_their_settings_and_a_request_without_a_size_takes_the_control_images():
    control = {"name": "edges", "image": _b64(_png(_photo())), "scale": 0.5, "start": 0.1, "end": 0.9}
    request = decode_body({"prompt": "a", "controlnets": [control]}, "application/json", POLICY)
    (choice,) = request.controlnets
    assert (choice.name, choice.scale, choice.start, choice.end, choice.preprocess) == ("edges", 0.5, 0.1, 0.9, None)
    assert choice.image.size == (96, 80) and choice.image.mode == "RGB"
    assert (request.width, request.height) == (96, 80)  # as diffusers' ControlNet pipelines size a call
    settings = {"preprocess": None, "low_threshold": 100, "high_threshold": 200, "scale": 0.5, "start": 0.1, "end": 0.9}
    assert request.parameters()["controlnets"] == [{"name": "edges", **settings}]  # not the image


def test_canny_turns_a_photo_into_diffusers_edge_map():
    import cv2
    import numpy as np

    photo = _photo()
    body = {"prompt": "a", "controlnets": [{"name": "edges", "image": _b64(_png(photo)), "preprocess": "canny"}]}
    (choice,) = decode_body(body, "application/json", POLICY).controlnets
    edges = cv2.Canny(photo, 100, 200)  # diffusers' ControlNet example
    assert np.array_equal(np.asarray(choice.image), np.stack([edges] * 3, axis=2))
    assert set(np.unique(edges)) == {0, 255}
    loose = {**body["controlnets"][0], "low_threshold": 0, "high_threshold": 10}
    (looser,) = decode_body({"prompt": "a", "controlnets": [loose]}, "application/json", POLICY).controlnets
    assert np.asarray(looser.image).sum() >= np.asarray(choice.image).sum()


@pytest.mark.parametrize(
    "control, field, rule",
    [
        ({"name": "../edges"}, "controlnets.0.name", "controlnet_name"),
        ({"name": "/etc"}, "controlnets.0.name", "controlnet_name"),
        ({"name": "edges", "image": "not base64!"}, "controlnets.0.image", "base64"),
        ({"name": "edges", "image": _b64(_png(_photo())[:-40])}, "controlnets.0.image", "image_corrupt"),
        ({"name": "edges", "scale": 2.5}, "controlnets.0.scale", "controlnet_scale"),
        ({"name": "edges", "scale": -0.1}, "controlnets.0.scale", "controlnet_scale"),
        ({"name": "edges", "scale": math.inf}, "controlnets.0.scale", "finite_number"),
        ({"name": "edges", "start": 0.5, "end": 0.5}, "controlnets.0.end", "controlnet_window"),
        ({"name": "edges", "start": 1.0}, "controlnets.0.end", "controlnet_window"),
        ({"name": "edges", "end": 1.5}, "controlnets.0.end", "less_than_equal"),
        ({"name": "edges", "preprocess": "depth"}, "controlnets.0.preprocess", "literal_error"),
        ({"name": "edges", "low_threshold": 250}, "controlnets.0.high_threshold", "threshold_order"),
        ({"name": "edges", "weights": "x"}, "controlnets.0.weights", "unknown_field"),
    ],
)
def test_bad_controlnets_are_refused_by_field_and_rule(control, field, rule):
    control = {"image": _b64(_png(_photo())), **control}
    errors, _ = errors_of({"prompt": "a", "controlnets": [control]})
    assert (field, rule) in errors, errors


def test_controlnets_are_refused_where_the_family_or_the_request_cannot_take_them():
    control = {"name": "edges", "image": _b64(_png(_photo()))}
    none = replace(POLICY, rules=FamilyRules("SD 9", controlnets=False))
    errors, message = errors_of({"prompt": "a", "controlnets": [control]}, policy=none)
    assert errors == [("controlnets", "controlnets_unavailable")] and "SD 9" in message
    # SD 3's ControlNet pipeline is text to image alone, without skip-layer guidance or a step cache
    sd3 = {"prompt": "a", "controlnets": [control]}
    for extra, field, named in (
        ({"image": _b64(_png(_photo()))}, "controlnets", "image"),
        ({"skip_guidance_layers": [7]}, "controlnets", "skip_guidance_layers"),
        ({"cache": {"mode": "first_block"}}, "cache", "cache"),
    ):
        errors, message = errors_of({**sd3, **extra}, policy=SD3_POLICY)
        assert errors == [(field, "controlnets_with")] and f"no {named}" in message and "SD 3.x" in message
    assert decode_body(sd3, JSON, SD3_POLICY).controlnets[0].name == "edges"
    # the operator's defaults of those leave a ControlNet request alone
    defaulted = replace(
        SD3_POLICY,
        defaults=SD3_POLICY.defaults.model_copy(update={"skip_guidance_layers": [7]}),
        cache=SD3_POLICY.cache.model_copy(update={"default": StepCache(mode="first_block")}),
        rules=replace(SD3_POLICY.rules, first_block_cache=True),
    )
    request = decode_body(sd3, JSON, defaulted)
    assert request.skip_guidance_layers is None and request.cache.mode == "off"
    plain = decode_body({"prompt": "a"}, JSON, defaulted)
    assert plain.skip_guidance_layers == [7] and plain.cache.mode == "first_block"
    errors, _ = errors_of({"prompt": "a", "controlnets": [control] * 4})
    assert errors == [("controlnets", "too_long")]
    import numpy as np

    mask = np.zeros((80, 96, 4), dtype=np.uint8)
    body = {"prompt": "a", "image": _b64(_png(_photo())), "mask": _b64(_png(mask)), "controlnets": [control]}
    errors, _ = errors_of(body)
    assert errors == [("controlnets", "controlnets_with_mask")]


def test_a_form_sends_control_images_as_file_parts():
    fields = {
        "prompt": b"a",
        "controlnets": b'[{"name": "edges", "scale": 0.8}, {"name": "depth", "image": "%s"}]'
        % _b64(_png(_photo(64, 64))).encode(),
        "controlnets.0.image": _png(_photo()),
    }
    request = decode_form(fields, POLICY)
    assert [choice.image.size for choice in request.controlnets] == [(96, 80), (64, 64)]
    assert request.controlnets[0].scale == 0.8
    with pytest.raises(RequestError) as caught:
        decode_form({**fields, "controlnets.5.image": _png(_photo())}, POLICY)
    assert [(item.field, item.rule) for item in caught.value.errors] == [("controlnets.5.image", "no_controlnet")]


def test_heuns_custom_timesteps_start_from_text_only():
    """diffusers' image pipelines cut a two-call scheduler's custom schedule by its calls: refused by
    field with an image, taken from text, and Heun's own schedule from an image is taken."""
    heun = {"prompt": "x", "scheduler": "heun", "timesteps": [999, 500, 100]}
    image = _b64(_png(_photo(64, 64)))
    fields, message = errors_of({**heun, "image": image})
    assert fields == [("image", "custom_schedule_from_image")]
    assert "scheduler heun runs custom timesteps from text only" in message
    assert "leave timesteps out, or name euler or dpmpp_2m or dpmpp_2m_sde" in message
    assert decode_body(heun, "application/json", POLICY).timesteps == [999, 500, 100]
    assert decode_body({"prompt": "x", "scheduler": "heun", "image": image}, "application/json", POLICY).image
    assert decode_body({**heun, "scheduler": "euler", "image": image}, "application/json", POLICY).timesteps
