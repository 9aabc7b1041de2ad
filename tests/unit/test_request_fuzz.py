"""Property-based tests of every input a client can send: the handler turns it into a valid request
within the policy's limits, or into a 400 whose JSON names each broken rule and its field (or
"body"); never another exception, and a fuzzed request never fails the request batched with it.

Inputs reach the handler as TorchServe hands them over: the frontend's Content-Type handling and
form decoding (``frontend_mime_type``, ``form_request``), the worker's pre-decoding of each part
(``worker_value``, which mirrors TorchServe's own and is checked against it), TorchServe's own
``Service.retrieve_data_for_inference`` building the row and headers, then ``sd_handler.to_incoming``.
"""

from __future__ import annotations

import io
import json
import struct
from dataclasses import replace
from typing import Any, get_args

import hypothesis.strategies as st
from hypothesis import assume, given, settings
from PIL import Image
from ts.context import Context
from ts.protocol.otf_message_handler import _retrieve_input_data
from ts.service import Service

from handler.api.encode import CONTENT_TYPES as IMAGE_CONTENT_TYPES
from handler.api.encode import JSON_CONTENT_TYPE
from handler.api.errors import UNKNOWN_FIELD_LABEL, RequestError
from handler.api.policy import RequestPolicy
from handler.api.protocol import IncomingRequest, Response, bad_request, decode
from handler.api.request import FIELD_LABELS, GenerationRequest
from handler.config import (
    CUSTOM_SCHEDULE_FIELDS,
    MAX_CONDITIONED_SIDE,
    MAX_SEED,
    OTHER_PROMPTS,
    SKIP_LAYER_FIELDS,
    FamilyRules,
    HandlerSettings,
    OutputFormat,
    ResponseFormat,
    SchedulerName,
    guided_at,
)
from handler.engine.jobs import PROMPT_FIELDS
from handler.sd_handler import to_incoming
from tests.harness.client_inputs import (
    CONTENT_TYPE_HEADERS,
    CONTENT_TYPES,
    FORM_PARTS,
    HEADER_TEXT,
    JSON_CONTENT_TYPES,
    RAW_BODIES,
    request_fields,
)
from tests.harness.serving import SHIPPED_CONFIG
from tests.harness.stand_ins import FAILS_AT_START, FAILS_STEPPING, RecordingSink, make_service

SHIPPED = HandlerSettings.from_model_yaml(SHIPPED_CONFIG).for_model(64, 64)
POLICY = RequestPolicy(SHIPPED.limits, SHIPPED.defaults)
# The other families' rules: more text encoders, SD 3.x's grid and scheduler.
SDXL = FamilyRules("SDXL", max_clip_skip=10, text_encoders=2, zeros_without_negative=True, size_conditioning=True)
SD3 = FamilyRules(
    "SD 3.x",
    ("flow_match_euler",),
    "flow_match_euler",
    16,
    "start",
    controlnets=False,
    max_clip_skip=10,
    guidance_rescale=False,
    text_encoders=3,
    transformer_blocks=24,
    custom_schedules=(("flow_match_euler", ("sigmas",)),),
    eta_schedulers=(),
)
SLG = HandlerSettings.from_model_yaml(
    {**SHIPPED_CONFIG, "handler": {**SHIPPED_CONFIG["handler"], "defaults": {"skip_guidance_layers": [7, 8, 9]}}}
).for_model(64, 64, SD3)
POLICIES = st.sampled_from(
    [
        POLICY,
        replace(POLICY, streaming=True),
        *(
            RequestPolicy(settings.limits, settings.defaults, rules=rules)
            for rules in (SDXL, SD3)
            for settings in [HandlerSettings.from_model_yaml(SHIPPED_CONFIG).for_model(64, 64, rules)]
        ),
        # an SD 3.5 Medium deployment's default skip-layer guidance: never on an unguided request
        RequestPolicy(SLG.limits, SLG.defaults, rules=SD3),
    ]
)
VALID = IncomingRequest({"prompt": "a red circle", "num_inference_steps": 3, "seed": 1}, JSON_CONTENT_TYPE)


# TorchServe, as the handler meets it.


def worker_value(content_type: str, raw: bytes) -> Any:
    """One input part as TorchServe's worker hands it to the handler. Mirrors
    ``ts.protocol.otf_message_handler._retrieve_input_data`` (TorchServe 0.12, input decoding on,
    its default): a part typed exactly ``application/json`` is ``json.loads``-ed, one typed
    ``text...`` decoded as UTF-8, and anything else, or what fails to decode, stays a bytearray."""
    value = bytearray(raw)
    try:
        if content_type == "application/json":
            return json.loads(value.decode("utf-8"))
        if content_type.startswith("text"):
            return value.decode("utf-8")
    except Exception:  # as TorchServe: RecursionError and too long integers included
        return value
    return value


def frontend_mime_type(content_type: str | None) -> str:
    """The Content-Type the frontend gives a body part: netty's ``HttpUtil.getMimeType``, the
    header up to its first ';' (not trimmed), sent as "" when absent or empty."""
    return content_type.split(";")[0] if content_type else ""


def handed_over(parts: list[tuple[str, str, bytes]], content_type: str | None) -> IncomingRequest:
    """The ``IncomingRequest`` the handler builds from the (name, content type, bytes) parts and
    the Content-Type header (None: not sent) of one HTTP request."""
    request = {
        "requestId": b"fuzzed",
        # Every HTTP request carries headers (a Host at least); a gRPC one none, which is how the handler tells
        # them apart.
        "headers": [{"name": b"Host", "value": b"127.0.0.1:8080"}]
        + ([] if content_type is None else [{"name": b"Content-Type", "value": content_type.encode()}]),
        "parameters": [
            {"name": name, "contentType": part_type, "value": worker_value(part_type, raw)}
            for name, part_type, raw in parts
        ],
    }
    headers, rows, _ = Service.retrieve_data_for_inference([request])
    context = Context("stable-diffusion", "", {}, 1, None, "0.12.0")
    context.request_processor = headers
    return to_incoming(rows[0], context, 0)


def body_request(raw: bytes, content_type: str | None) -> IncomingRequest:
    """A request with this body and Content-Type header (the frontend sends the body as one part)."""
    return handed_over([("body", frontend_mime_type(content_type), raw)], content_type)


def form_request(parts: list[tuple[str, bytes, str | None]], multipart: bool) -> IncomingRequest:
    """A multipart or urlencoded form (or the query string of TorchServe's legacy predict URLs): a
    plain field reaches the worker untyped, its text re-encoded by the frontend as UTF-8; a file
    upload (multipart only) keeps its bytes and Content-Type."""
    sent = [
        (name, upload, raw) if upload and multipart else (name, "", raw.decode("utf-8", "replace").encode())
        for name, raw, upload in parts
    ]
    return handed_over(sent, "multipart/form-data; boundary=fuzz" if multipart else "application/x-www-form-urlencoded")


def json_fields_request(fields: dict[str, Any], ensure_ascii: bool, content_type: str | None) -> IncomingRequest:
    """``fields`` as a JSON body (lone surrogates escaped, or written raw: not UTF-8)."""
    return body_request(json.dumps(fields, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass"), content_type)


JSON_FIELD_REQUESTS = st.builds(
    json_fields_request, request_fields(POLICY.limits), st.booleans(), st.sampled_from(JSON_CONTENT_TYPES)
)
RAW_BODY_REQUESTS = st.builds(body_request, RAW_BODIES, CONTENT_TYPE_HEADERS)
FORM_REQUESTS = st.builds(form_request, FORM_PARTS, st.booleans())


# The property.


def _refuse_constant(name: str) -> None:
    raise AssertionError(f"error JSON holds {name}, which is not JSON")


def sent_names(incoming: IncomingRequest) -> set[str]:
    """The field names a request sent: its form fields, or the keys of its JSON object body."""
    body = incoming.body
    if isinstance(body, bytearray):
        try:
            body = json.loads(body)
        except (ValueError, RecursionError):
            body = None
    return set(body) if isinstance(body, dict) else set(incoming.fields)


def assert_clear_refusal(error: RequestError, sent: set[str]) -> None:
    """Each error names a request field or "body" (an unknown field: the name sent) and a rule,
    with a message; its 400 is ASCII JSON without NaN or Infinity that says the same."""
    assert error.errors
    for item in error.errors:
        top = item.field.split(".")[0] if item.nested else item.field  # loras.0.name: within loras
        assert top in FIELD_LABELS or item.rule == "unknown_field" and (item.field in sent or item.nested), item
        assert item.label(FIELD_LABELS) in FIELD_LABELS | {UNKNOWN_FIELD_LABEL}
        assert isinstance(item.rule, str) and item.rule and isinstance(item.message, str) and item.message, item
    response = bad_request(error)
    assert response.status == 400 and response.content_type == JSON_CONTENT_TYPE and response.body.isascii()
    payload = json.loads(response.body, parse_constant=_refuse_constant)
    assert payload["code"] == 400 and payload["type"] == "InvalidRequest" and payload["message"]
    assert payload["errors"] == [item.as_dict() for item in error.errors]


def assert_within_policy(request: GenerationRequest, policy: RequestPolicy) -> None:
    """Every value has its type and is within the policy's limits, with a concrete seed."""
    limits = policy.limits
    for field in PROMPT_FIELDS:
        text = getattr(request, field)
        assert text is None or type(text) is str and len(text) <= limits.max_prompt_chars, field
        if text:
            text.encode("utf-8")  # no lone surrogates: the tokenizer refuses them
    assert request.prompt.strip()
    encoders = policy.rules.text_encoders
    assert all(getattr(request, field) is None for field, encoder in OTHER_PROMPTS.items() if encoder > encoders)
    sizes = request.size_conditioning()
    if sizes is not None:
        assert policy.rules.size_conditioning
        assert all(0 <= value <= MAX_CONDITIONED_SIDE for pair in vars(sizes).values() if pair for value in pair)
        if request.image is None and sizes.negative_original_size is None:
            assert sizes.negative_target_size is None and sizes.negative_crops_coords_top_left is None
    guidance = request.skip_layer_guidance()
    if guidance is None:
        assert all(getattr(request, field) is None for field in SKIP_LAYER_FIELDS)
    else:
        assert guided_at(request.guidance_scale) and policy.rules.transformer_blocks
        assert all(type(layer) is int and 0 <= layer < policy.rules.transformer_blocks for layer in guidance.layers)
        assert 0 <= guidance.start < guidance.stop <= 1 and 0 <= guidance.scale <= limits.max_guidance_scale
    for field in CUSTOM_SCHEDULE_FIELDS:
        values = getattr(request, field)
        if values is not None:
            assert request.scheduler in policy.rules.schedulers_taking(field)
            assert policy.rules.schedule_steps(field, request.scheduler, len(values)) == request.num_inference_steps
            assert all(later < earlier for earlier, later in zip(values, values[1:], strict=False))
            assert 0 <= values[-1] and (field == "sigmas" or values[0] < policy.rules.train_timesteps)
    assert request.timesteps is None or request.sigmas is None
    assert type(request.eta) is float and (request.eta == 0 or request.scheduler in policy.rules.eta_schedulers)
    for value, upper in (
        (request.num_inference_steps, limits.max_inference_steps),
        (request.num_images_per_prompt, limits.max_images_per_request),
    ):
        assert type(value) is int and 1 <= value <= upper
    assert type(request.guidance_scale) is float and 0 <= request.guidance_scale <= limits.max_guidance_scale
    assert type(request.seed) is int and 0 <= request.seed <= MAX_SEED
    for side in (request.width, request.height):
        assert type(side) is int and side % 8 == 0 and limits.min_side <= side <= limits.max_side
    assert request.width * request.height <= limits.max_pixels
    assert request.scheduler in get_args(SchedulerName) and request.output_format in get_args(OutputFormat)
    assert request.response_format in get_args(ResponseFormat)
    assert request.stream is False or request.stream is True and policy.streaming


def assert_decodes_or_is_refused(incoming: IncomingRequest, policy: RequestPolicy) -> None:
    try:
        request = decode(incoming, policy)
    except RequestError as error:
        assert_clear_refusal(error, sent_names(incoming))
    else:
        assert_within_policy(request, policy)


@settings(max_examples=500)
@given(incoming=JSON_FIELD_REQUESTS, policy=POLICIES)
def test_any_json_values_in_any_fields_give_a_valid_request_or_a_400_naming_them(incoming, policy):
    """(a) Every field (and unknown ones) holding any JSON value: numbers of every size, -0.0,
    NaN, strings with control characters and lone surrogates, nested arrays and objects."""
    assert_decodes_or_is_refused(incoming, policy)


@settings(max_examples=500)
@given(incoming=RAW_BODY_REQUESTS, policy=POLICIES)
def test_any_body_with_any_content_type_gives_a_valid_request_or_a_400_naming_it(incoming, policy):
    """(b) Any bytes (JSON texts with every escape and number spelling, text in any encoding,
    binary) under any Content-Type, or none."""
    assert_decodes_or_is_refused(incoming, policy)


@settings(max_examples=300)
@given(incoming=FORM_REQUESTS, policy=POLICIES)
def test_any_form_or_query_fields_give_a_valid_request_or_a_400_naming_them(incoming, policy):
    """(c) Form fields of any name and bytes, plain or file uploads of any Content-Type."""
    assert_decodes_or_is_refused(incoming, policy)


class _Connection:
    """The worker's socket, delivering ``data``."""

    def __init__(self, data: bytes):
        self.stream = io.BytesIO(data)

    def recv(self, size: int) -> bytes:
        return self.stream.read(size)


@settings(max_examples=200)
@given(
    content_type=st.sampled_from([value for value in CONTENT_TYPES if value is not None]) | HEADER_TEXT, raw=RAW_BODIES
)
def test_worker_value_mirrors_torchserves_own_decoding(content_type, raw):
    """``worker_value`` gives what TorchServe's ``_retrieve_input_data`` reads from the frame the
    frontend sends (repr compared: NaN is not equal to itself)."""
    frame = b"".join(struct.pack("!i", len(part)) + part for part in (b"body", content_type.encode(), raw))
    real = _retrieve_input_data(_Connection(frame))
    assert (real["name"], real["contentType"]) == ("body", content_type)
    assert repr(real["value"]) == repr(worker_value(content_type, raw))


# The service: a fuzzed request beside a valid one.

SERVICE_POLICY = make_service(streaming=False).policy
ANY_REQUEST = st.one_of(
    st.builds(
        json_fields_request, request_fields(SERVICE_POLICY.limits), st.booleans(), st.sampled_from(JSON_CONTENT_TYPES)
    ),
    RAW_BODY_REQUESTS,
    FORM_REQUESTS,
)


def asks_the_stand_in_to_fail(incoming: IncomingRequest) -> bool:
    try:
        return decode(incoming, SERVICE_POLICY).prompt in (FAILS_AT_START, FAILS_STEPPING)
    except RequestError:
        return False


def assert_images(response: Response) -> None:
    """A 200 with the request's images: raw image bytes, or JSON with base64 images."""
    if response.content_type in IMAGE_CONTENT_TYPES.values():
        Image.open(io.BytesIO(response.body)).verify()
    else:
        assert response.content_type == JSON_CONTENT_TYPE and json.loads(response.body)["images"]


@settings(max_examples=200)
@given(fuzzed=ANY_REQUEST)
def test_a_fuzzed_request_never_fails_the_valid_request_in_its_batch(fuzzed):
    """(d) The valid request gets its image whatever its batchmate is; the fuzzed one gets its
    images or a clear 400, never a 5xx; rejections are counted under fixed labels only."""
    assume(not asks_the_stand_in_to_fail(fuzzed))
    sink = RecordingSink()
    responses = make_service(sink=sink, streaming=False).run_batch({"fuzzed": fuzzed, "valid": VALID})
    valid, answer = responses["valid"], responses["fuzzed"]
    assert valid.status == 200 and valid.content_type == "image/png" and valid.headers["X-Seed"] == "1"
    assert Image.open(io.BytesIO(valid.body)).getpixel((0, 0)) == (1, 1, 1)
    assert answer.status in (200, 400), answer.body[:300]
    if answer.status == 200:
        assert_images(answer)
    else:
        payload = json.loads(answer.body, parse_constant=_refuse_constant)
        assert payload["type"] == "InvalidRequest" and payload["errors"]
        for error in payload["errors"]:
            assert (
                error["field"].split(".")[0] in FIELD_LABELS  # loras.0.name: within loras
                or error["rule"] == "unknown_field"
                and error["field"] in sent_names(fuzzed)
            )
    labels = {labels for name, _, labels in sink.records if name == "sd_invalid_requests_total"}
    assert labels <= {(label,) for label in FIELD_LABELS | {UNKNOWN_FIELD_LABEL}}
