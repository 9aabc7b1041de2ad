"""Fuzzed requests through the real server: a bounded, reproducible sample of what
``tests/unit/test_request_fuzz.py`` checks in-process. Each fuzzed request is sent at the same time
as a valid one so that both can share a batch. The fuzzed one gets its images or a 4xx (the
handler's names each broken field or "body"; TorchServe's own, such as 413, are accepted), never
a 5xx; the valid one always gets its PNG; and afterwards the same worker process serves."""

from __future__ import annotations

import base64
import io
import json
import string
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import hypothesis.strategies as st
import pytest
import requests
from hypothesis import Phase, example, given, settings
from PIL import Image

from handler.api.request import FIELD_LABELS
from handler.config import HandlerSettings
from tests.harness.client_inputs import (
    BASE_FIELDS,
    CONTENT_TYPE_HEADERS,
    FIELDS,
    FORM_VALUES,
    JSON_CONTENT_TYPES,
    RAW_BODIES,
    UPLOAD_CONTENT_TYPES,
    request_fields,
)
from tests.harness.serving import SHIPPED_CONFIG, Client, worker_processes

EXAMPLES = 50  # most are refused at admission, the rest are small
VALID = {"prompt": "a red circle", "num_inference_steps": 2, "seed": 1}
LIMITS = HandlerSettings.from_model_yaml(SHIPPED_CONFIG).limits
IMAGE_TYPES = ("image/png", "image/jpeg", "image/webp")


def _headers(content_type: str | None) -> dict[str, str]:
    return {} if content_type is None else {"Content-Type": content_type}


# What a fuzzed request sends: keyword arguments of ``Client.predict``.
JSON_BODIES = st.builds(
    lambda fields, ensure_ascii, content_type: {
        "data": json.dumps(fields, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass"),
        "headers": _headers(content_type),
    },
    request_fields(LIMITS),
    st.booleans(),
    st.sampled_from(JSON_CONTENT_TYPES),
)
ANY_BODIES = st.builds(
    lambda raw, content_type: {"data": raw, "headers": _headers(content_type)}, RAW_BODIES, CONTENT_TYPE_HEADERS
)
# Form field names netty parses as sent (its own multipart parsing of odd names is TorchServe's business).
FORM_NAMES = st.sampled_from([*FIELDS, "body", "data"]) | st.text(
    string.ascii_letters + string.digits + "_-. ", min_size=1, max_size=12
)
BASE_FORM = [(name, str(value).encode()) for name, value in BASE_FIELDS.items()]
MULTIPART_FORMS = st.builds(
    lambda base, parts: {
        "files": [(name, (None, value)) for name, value in base]
        + [(name, ("upload" if upload else None, value, upload)) for name, value, upload in parts]
    },
    st.sampled_from([BASE_FORM, []]),
    st.lists(st.tuples(FORM_NAMES, FORM_VALUES, UPLOAD_CONTENT_TYPES), max_size=4),
)
URLENCODED_FORMS = st.builds(
    lambda base, fields: {"data": base + fields},
    st.sampled_from([BASE_FORM, []]),
    st.lists(st.tuples(FORM_NAMES, FORM_VALUES), max_size=4),
)
SENT = st.one_of(JSON_BODIES, ANY_BODIES, MULTIPART_FORMS, URLENCODED_FORMS)


def send_together(client: Client, sent: dict[str, Any]) -> tuple[requests.Response, requests.Response]:
    """The fuzzed request and the valid one, sent at the same time."""
    with ThreadPoolExecutor(2) as pool:
        fuzzed = pool.submit(client.predict, content_type=None, **sent)
        valid = pool.submit(client.predict, VALID)
        return fuzzed.result(), valid.result()


def assert_images(response: requests.Response) -> None:
    """Raw image bytes, JSON with base64 images, or (streamed) NDJSON ending with them."""
    kind = response.headers["Content-Type"]
    if kind in IMAGE_TYPES:
        encoded = [response.content]
    else:
        payload = json.loads(response.text.splitlines()[-1])
        encoded = [base64.b64decode(image) for image in payload["images"]]
    assert encoded
    for data in encoded:
        Image.open(io.BytesIO(data)).verify()


# TorchServe's frontend (netty's form decoder) answers a malformed form body 500 itself, before any
# worker sees it: a multipart part with a charset Java does not know, a boundary without a value,
# a bad %-escape in a urlencoded body. Documented in docs/reliability.md, pinned in test_hostile_input.py.
FRONTEND_FORM_DECODER_ERROR = "ErrorDataDecoderException"


def frontend_form_decoder_error(response: requests.Response) -> bool:
    try:
        return response.status_code == 500 and response.json().get("type") == FRONTEND_FORM_DECODER_ERROR
    except ValueError:
        return False


def assert_images_or_clear_4xx(response: requests.Response) -> None:
    if frontend_form_decoder_error(response):
        return
    assert response.status_code < 500, f"{response.status_code}: {response.text[:500]}"
    if response.status_code == 200:
        assert_images(response)
        return
    assert 400 <= response.status_code < 500, response.status_code
    try:
        payload = response.json()
    except ValueError:
        payload = None
    if isinstance(payload, dict) and payload.get("type") == "InvalidRequest":  # the handler's; else TorchServe's own
        assert response.status_code == 400 and payload["errors"], payload
        for error in payload["errors"]:
            # a field, or a part of one (loras.0.scale), or an unknown field named as sent
            assert error["field"].split(".")[0] in FIELD_LABELS or error["rule"] == "unknown_field", error
            assert error["rule"] and error["message"], error


@pytest.fixture(scope="module")
def workers_before(server) -> list[tuple[str, int, str]]:
    return worker_processes(server)


def _json_body(text: bytes) -> dict[str, Any]:
    return {"data": text, "headers": {"Content-Type": "application/json"}}


# What the unit fuzzing found (each a 500 before its fix), end to end.
@example(sent=_json_body(b'{"prompt": "a \\ud800 circle", "num_inference_steps": 2}'))
@example(sent=_json_body(b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}"))
@example(sent=_json_body(b'{"prompt": ' + b"[" * 990 + b"]" * 990 + b"}"))
@example(
    sent=_json_body(b'{"prompt": "x", "a\\n[METRICS]sd_images_total.images:1000|#model_name:stable-diffusion": 1}')
)
# A 400 naming a part of a field (loras.0.scale), which the fuzzing drew once.
@example(sent=_json_body(b'{"prompt": "x", "num_inference_steps": 2, "loras": [{"name": "outline", "scale": 1e9}]}'))
@settings(max_examples=EXAMPLES, phases=(Phase.explicit, Phase.generate))  # no shrinking against a server: minutes
@given(sent=SENT)
def test_a_fuzzed_request_gets_images_or_a_clear_4xx_and_never_fails_its_batchmate(client, workers_before, sent):
    fuzzed, valid = send_together(client, sent)
    assert_images_or_clear_4xx(fuzzed)
    assert valid.status_code == 200, valid.text[:500]
    assert valid.headers["Content-Type"] == "image/png" and valid.headers["X-Seed"] == "1"
    assert Image.open(io.BytesIO(valid.content)).size == (64, 64)


def test_the_worker_that_served_the_fuzzing_still_serves(client, server, workers_before):
    """Same worker processes as before the fuzzing (no restart), and healthy."""
    assert worker_processes(server) == workers_before
    ping = requests.get(f"{server.addresses.inference}/ping", headers=server.auth(), timeout=30)
    assert ping.status_code == 200 and ping.json()["status"] == "Healthy", ping.text
    assert client.predict(VALID).status_code == 200
