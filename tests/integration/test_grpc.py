"""TorchServe's gRPC inference API through ``clients.grpc_client`` against a real server: the image
HTTP gives, a plain prompt, errors as ordinary replies (TorchServe 0.12 sends no status over gRPC),
keys, ``StreamPredictions`` in both batching modes, continuous batching's whole answers, the CLI and
the README's gRPC examples."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from clients.grpc_client import MODEL_NAME, as_error, is_image, main, messages, predict, services, stream_predictions
from server import TorchServe
from server.paths import ROOT
from tests.harness.images import assert_same_image, decode_json_images, decode_png
from tests.harness.readme import run_example
from tests.harness.serving import FAST, wait_until_denoising

# Longer than one continuous-batching iteration (iteration_budget_ms, 100 ms) on any device.
LONG = {"prompt": "a red circle", "seed": 1, "num_inference_steps": 100}
STREAM_DEADLINE = 120.0  # seconds


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def call(server: TorchServe, data: bytes) -> bytes:
    return predict(server.addresses.grpc_inference, server.keys.inference, data)


def test_a_json_body_gives_the_png_http_gives(server, client):
    reply = call(server, body(prompt="a red circle", seed=7, **FAST))
    assert is_image(reply) and as_error(reply) is None
    assert_same_image(decode_png(reply), client.image(prompt="a red circle", seed=7))


def test_a_plain_prompt_is_the_prompt(server):
    assert decode_png(call(server, b"a blue square")).shape == (64, 64, 3)


def test_a_json_answer_carries_its_images(server, client):
    reply = call(server, body(prompt="a green triangle", seed=3, response_format="json", **FAST))
    assert as_error(reply) is None
    assert_same_image(decode_json_images(json.loads(reply))[0], client.image(prompt="a green triangle", seed=3))


def test_a_bad_request_is_a_reply_holding_the_json_error_and_the_server_still_serves(server):
    error = as_error(call(server, body(prompt="a red circle", width=100, **FAST)))
    assert error["code"] == 400 and error["type"] == "InvalidRequest"
    assert [(item["field"], item["rule"]) for item in error["errors"]] == [("width", "multiple_of")]
    assert is_image(call(server, body(prompt="a red circle", **FAST)))


@pytest.mark.parametrize(
    "authorization", [None, "Bearer wrong", "management"], ids=["missing", "wrong", "management-key"]
)
def test_a_call_without_the_inference_key_is_refused(server, authorization):
    if authorization == "management":
        authorization = f"Bearer {server.keys.management}"
    metadata = (("authorization", authorization),) if authorization else ()
    request = messages.PredictionsRequest(model_name=MODEL_NAME, input={"data": b"a red circle"})
    with grpc.insecure_channel(server.addresses.grpc_inference) as channel, pytest.raises(grpc.RpcError) as refused:
        services.InferenceAPIsServiceStub(channel).Predictions(request, metadata=metadata, timeout=60)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "Token Authorization failed" in refused.value.details()


@pytest.mark.parametrize("mode", ["dynamic", "continuous"])
def test_stream_predictions_answers_in_one_reply_and_the_worker_survives(request, mode):
    """Without the handler's ``ts_stream_next: false`` on a one-part answer, TorchServe 0.12 sends
    the reply, then fails the worker and the call (INTERNAL "Worker died.")."""
    server, client = request.getfixturevalue(f"{mode}_server"), request.getfixturevalue(f"{mode}_client")
    target, key = server.addresses.grpc_inference, server.keys.inference
    replies = list(stream_predictions(target, key, body(prompt="a red circle", seed=7, **FAST)))
    assert len(replies) == 1
    assert_same_image(decode_png(replies[0]), client.image(prompt="a red circle", seed=7))
    [rejected] = stream_predictions(target, key, body(prompt="a red circle", stream=True))
    error = as_error(rejected)["errors"][0]
    assert error["field"] == "stream" and "over HTTP only" in error["message"]
    assert set(server.worker_status()) == {"READY"}


def test_continuous_batching_answers_grpc_whole_while_http_requests_share_its_steps(
    continuous_server, continuous_client
):
    """TorchServe 0.12 ends a gRPC call with the first part of an answer (GRPCJob.isOpen is
    inverted) and continuous batching answers in parts, so the handler holds its call until the
    gRPC request is done: the reply is the whole image, and HTTP requests in flight still finish."""
    target, key = continuous_server.addresses.grpc_inference, continuous_server.keys.inference
    with ThreadPoolExecutor(2) as pool:
        http = pool.submit(continuous_client.predict, {**LONG, "seed": 2})
        wait_until_denoising(continuous_server)
        reply = predict(target, key, body(**LONG))
        assert http.result().status_code == 200
    assert_same_image(decode_png(reply), continuous_client.image(**LONG))
    replies = list(stream_predictions(target, key, body(**LONG), timeout=STREAM_DEADLINE))
    assert len(replies) == 1 and is_image(replies[0])
    assert set(continuous_server.worker_status()) == {"READY"}


def test_the_cli_exits_non_zero_printing_the_json_error(server, tmp_path, capsys):
    key_file = server.workdir / "key_file.json"
    argv = [
        "a red circle",
        "--target",
        server.addresses.grpc_inference,
        "--key-file",
        str(key_file),
        "--output",
        str(tmp_path / "x.png"),
    ]
    assert main([*argv, "--json", '{"width": 100}']) == 1
    assert json.loads(capsys.readouterr().err)["errors"][0]["field"] == "width"
    assert not (tmp_path / "x.png").exists()
    assert main([*argv, "--json", '{"response_format": "json", "num_inference_steps": 4}']) == 0
    assert decode_png((tmp_path / "x.png").read_bytes()).shape == (64, 64, 3)


@pytest.fixture
def repo_cwd(cwd, server, monkeypatch) -> Path:
    """The README examples' working directory laid out like the repository root, with the test
    server's gRPC address in ``$GRPC_TARGET``."""
    for name in (".venv", "clients"):
        (cwd / name).symlink_to(ROOT / name)
    monkeypatch.setenv("GRPC_TARGET", server.addresses.grpc_inference)
    return cwd


def test_the_readme_grpc_examples_run_as_written(server, client, repo_cwd):
    run_example("grpc-cli", server, repo_cwd)
    assert_same_image(
        decode_png((repo_cwd / "image.png").read_bytes()),
        client.image(prompt="a red circle", seed=42, num_inference_steps=25),
    )
    output = run_example("grpc-python", server, repo_cwd).stdout.splitlines()
    assert (
        output[0].startswith("image, ")
        and output[1] == "400 width: Input should be a multiple of 8 for SD 1.x models (given: 100)"
    )
