"""A gRPC client of TorchServe's inference API for the stable-diffusion model.

The service definition (``clients/inference.proto``) is compiled when this module is imported;
no generated code is kept. The body goes in the request's ``data`` input as it would over HTTP: a
JSON object of request fields, or the prompt alone. TorchServe 0.12 does not send the handler's
status over gRPC, so an error arrives as an ordinary reply holding the JSON error; ``as_error``
tells it from an answer.

    .venv/bin/python -m clients.grpc_client "a red circle" --output image.png
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

logger = logging.getLogger("grpc_client")

PROTO = "clients/inference.proto"  # resolved on sys.path, like this package
messages, services = grpc.protos_and_services(PROTO)

MODEL_NAME = "stable-diffusion"
# The gRPC inference API: $GRPC_TARGET, else where config.properties puts it.
DEFAULT_TARGET = os.environ.get("GRPC_TARGET", "127.0.0.1:7070")
DEFAULT_KEY_FILE = Path("runtime/key_file.json")
TIMEOUT_SECONDS = 330.0  # longer than any answer takes (the server's default_response_timeout: 300 s)
MAX_RETRIES = 2  # sends again of a call that ended without an answer
RETRY_AFTER_S = 1.0
RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
IMAGE_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff")  # PNG, JPEG; WebP is RIFF....WEBP


def read_key(key_file: Path) -> str:
    """The inference key from TorchServe's key_file.json."""
    return json.loads(key_file.read_text())["inference"]["key"]


def _request(key: str, body: bytes, model_name: str, timeout: float) -> dict:
    """The arguments of a call sending ``body`` with ``key``."""
    return {
        "request": messages.PredictionsRequest(model_name=model_name, input={"data": body}),
        "metadata": (("authorization", f"Bearer {key}"),),
        "timeout": timeout,
    }


def predict(
    target: str, key: str, body: bytes, model_name: str = MODEL_NAME, timeout: float = TIMEOUT_SECONDS
) -> bytes:
    """``Predictions``: the answer's bytes (an image, JSON, or the JSON error). Raises
    ``grpc.RpcError`` when TorchServe refuses the call (``PERMISSION_DENIED`` for a missing or wrong
    key)."""
    with grpc.insecure_channel(target) as channel:
        return (
            services.InferenceAPIsServiceStub(channel)
            .Predictions(**_request(key, body, model_name, timeout))
            .prediction
        )


def predict_retrying(
    target: str, key: str, body: bytes, model_name: str = MODEL_NAME, timeout: float = TIMEOUT_SECONDS
) -> tuple[bytes, int]:
    """``predict``, sent again up to ``MAX_RETRIES`` times, ``RETRY_AFTER_S`` apart, while the call
    ends without an answer: ``UNAVAILABLE`` (the connection ended: a server stopped; or TorchServe's
    queue was full) or ``DEADLINE_EXCEEDED`` (no answer within ``timeout``: a worker removed
    mid-batch). Returns the answer and the retries. Send a seed in ``body`` so that a retry gives
    the same image."""
    for retries in range(MAX_RETRIES + 1):
        try:
            return predict(target, key, body, model_name, timeout), retries
        except grpc.RpcError as error:
            if error.code() not in RETRIED or retries == MAX_RETRIES:
                raise
            logger.warning("no answer (%s: %s); sending it again", error.code().name, error.details())
            time.sleep(RETRY_AFTER_S)
    raise AssertionError("unreachable")


def stream_predictions(
    target: str, key: str, body: bytes, model_name: str = MODEL_NAME, timeout: float = TIMEOUT_SECONDS
) -> Iterator[bytes]:
    """``StreamPredictions``: one reply per part of the answer (one part: a server with continuous
    batching, whose answers leave in parts, refuses gRPC requests, since TorchServe 0.12 ends a gRPC
    call after the first part)."""
    with grpc.insecure_channel(target) as channel:
        for reply in services.InferenceAPIsServiceStub(channel).StreamPredictions(
            **_request(key, body, model_name, timeout)
        ):
            yield reply.prediction


def is_image(reply: bytes) -> bool:
    """Whether ``reply`` is PNG, JPEG or WebP bytes."""
    return reply.startswith(IMAGE_MAGIC) or (reply[:4] == b"RIFF" and reply[8:12] == b"WEBP")


def as_error(reply: bytes) -> dict | None:
    """The JSON error ``reply`` holds (a JSON object with ``code`` >= 400), else None (an image, a
    JSON answer with ``images``)."""
    if is_image(reply):
        return None
    try:
        payload = json.loads(reply)
    except ValueError:
        return None
    code = payload.get("code") if isinstance(payload, dict) else None
    return payload if isinstance(code, int) and code >= 400 else None


def _body(prompt: str, fields: str | None) -> bytes:
    """A JSON object of the prompt and ``fields`` (a JSON object), with a seed drawn here unless
    given (a retry then gives the same image)."""
    return json.dumps({"prompt": prompt, "seed": random.randrange(2**32), **json.loads(fields or "{}")}).encode()


def _image(answer: bytes) -> bytes:
    """The image of an answer: its bytes, or the first image of a JSON answer."""
    return answer if is_image(answer) else base64.b64decode(json.loads(answer)["images"][0])


def _fail(message: str) -> int:
    print(message, file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate an image over TorchServe's gRPC inference API.")
    parser.add_argument("prompt")
    parser.add_argument("--output", type=Path, default=Path("image.png"), help="where the image goes [%(default)s]")
    parser.add_argument(
        "--target", default=DEFAULT_TARGET, help="host:port of the gRPC inference API [%(default)s; $GRPC_TARGET]"
    )
    parser.add_argument(
        "--key-file", type=Path, default=DEFAULT_KEY_FILE, help="TorchServe's key_file.json [%(default)s]"
    )
    parser.add_argument("--json", dest="fields", help="more request fields as a JSON object, e.g. '{\"seed\": 42}'")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        key = read_key(args.key_file)
    except (OSError, ValueError, KeyError) as error:
        return _fail(f"no inference key in {args.key_file} ({error!r}); is the server running?")
    try:
        body = _body(args.prompt, args.fields)
    except (ValueError, TypeError) as error:
        return _fail(f"--json must be a JSON object of request fields: {error}")
    try:
        answer, retries = predict_retrying(args.target, key, body)
    except grpc.RpcError as error:
        return _fail(f"{error.code().name}: {error.details()}")
    if retries:
        logger.info("answered after %d retr%s", retries, "y" if retries == 1 else "ies")
    error = as_error(answer)
    if error is not None:
        return _fail(json.dumps(error))
    args.output.write_bytes(_image(answer))
    logger.info("wrote %s", args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
