"""How the gRPC client tells an image, a JSON answer and a JSON error apart, builds a request, and
sends again a call that ended without an answer."""

import json

import grpc
import pytest

from clients import grpc_client
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


def test_the_body_is_a_json_object_of_the_prompt_and_fields_with_a_seed_so_a_retry_gives_the_same_image():
    drawn = json.loads(_body("a red circle", None))
    assert drawn["prompt"] == "a red circle" and 0 <= drawn["seed"] < 2**32
    assert json.loads(_body("a red circle", '{"seed": 42}')) == {"prompt": "a red circle", "seed": 42}


def test_a_request_carries_the_body_as_data_and_the_key_as_bearer_metadata():
    call = _request("KEY", b"a red circle", MODEL_NAME, 30.0)
    assert call["request"].model_name == MODEL_NAME and dict(call["request"].input) == {"data": b"a red circle"}
    assert call["metadata"] == (("authorization", "Bearer KEY"),) and call["timeout"] == 30.0


class Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "Socket closed"


@pytest.mark.parametrize(("failures", "retries"), [(0, 0), (2, 2)])
def test_a_call_that_ended_without_an_answer_is_sent_again_with_the_same_body(monkeypatch, failures, retries):
    sent: list[bytes] = []

    def predict(target, key, body, model_name, timeout):
        sent.append(body)
        if len(sent) <= failures:
            raise Unavailable()
        return b"answer"

    monkeypatch.setattr(grpc_client, "predict", predict)
    monkeypatch.setattr(grpc_client, "RETRY_AFTER_S", 0.0)
    assert grpc_client.predict_retrying("127.0.0.1:7070", "key", b"{}") == (b"answer", retries)
    assert sent == [b"{}"] * (retries + 1)


class Refused(Unavailable):
    def code(self):
        return grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize(("error", "calls"), [(Unavailable, 1 + grpc_client.MAX_RETRIES), (Refused, 1)])
def test_a_call_refused_or_unanswered_too_often_is_not_sent_again(monkeypatch, error, calls):
    sent = []

    def predict(*args):
        sent.append(args)
        raise error()

    monkeypatch.setattr(grpc_client, "predict", predict)
    monkeypatch.setattr(grpc_client, "RETRY_AFTER_S", 0.0)
    with pytest.raises(error):
        grpc_client.predict_retrying("127.0.0.1:7070", "key", b"{}")
    assert len(sent) == calls
