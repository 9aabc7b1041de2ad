"""How the gRPC client tells an image, a JSON answer and a JSON error apart, and builds a request."""

import json

import pytest

from clients.grpc_client import MODEL_NAME, _body, _request, as_error, is_image

ERROR = {"code": 400, "type": "InvalidRequest", "message": "width: ...", "errors": [{"field": "width"}]}


@pytest.mark.parametrize("reply", [b"\x89PNG\r\n\x1a\n...", b"\xff\xd8\xff\xe0...", b"RIFF\x10\x00\x00\x00WEBPVP8 "])
def test_image_bytes_are_images_not_errors(reply):
    assert is_image(reply) and as_error(reply) is None


@pytest.mark.parametrize(
    "reply",
    [
        json.dumps({"images": ["iVBORw0KGgo="], "seed": 1}).encode(),
        b'{"event": "progress", "step": 1, "total_steps": 4}\n',
        b'{"code": 200}',
        b'{"code": "400"}',
        b"[400]",
        b"not json",
        b"",
    ],
)
def test_answers_and_other_bytes_are_not_errors(reply):
    assert as_error(reply) is None


@pytest.mark.parametrize(
    "error", [ERROR, {"code": 507, "type": "OutOfMemory", "message": "..."}, {"event": "error", **ERROR}]
)
def test_a_json_object_with_an_error_code_is_the_error(error):
    assert as_error(json.dumps(error).encode()) == error


def test_the_body_is_the_prompt_alone_or_a_json_object_of_the_fields():
    assert _body("a red circle", None) == b"a red circle"
    assert json.loads(_body("a red circle", '{"seed": 42}')) == {"prompt": "a red circle", "seed": 42}


def test_a_request_carries_the_body_as_data_and_the_key_as_bearer_metadata():
    call = _request("KEY", b"a red circle", MODEL_NAME, 30.0)
    assert call["request"].model_name == MODEL_NAME and dict(call["request"].input) == {"data": b"a red circle"}
    assert call["metadata"] == (("authorization", "Bearer KEY"),) and call["timeout"] == 30.0
