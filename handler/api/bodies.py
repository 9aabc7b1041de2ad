"""Bodies and forms as TorchServe hands them over, turned into request fields: JSON objects, a
``text/plain`` prompt, a body without a Content-Type, form and query fields (text, with file parts).
A form's list and object fields (``loras``, ``controlnets``, ``cache``, ``skip_guidance_layers``, a
custom ``timesteps`` or ``sigmas``, SDXL's sizes) arrive as JSON text and are parsed here, once."""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from handler.api.errors import FieldError, RequestError
from handler.api.policy import RequestPolicy
from handler.api.request import GenerationRequest, validate_fields
from handler.config import CUSTOM_SCHEDULE_FIELDS, SIZE_CONDITIONING_FIELDS

TEXT_CONTENT_PREFIX = "text/"
# A form's file part holding the control image of a ControlNet entry.
CONTROL_FILE = re.compile(r"controlnets\.(\d{1,2})\.image")


def _decode_text(raw: bytes | bytearray) -> str:
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError as error:
        raise RequestError.single(
            "body", "utf8", f"body is not valid UTF-8: {error.reason} at byte {error.start}"
        ) from None


def _parse_json(raw: bytes | bytearray) -> Any:
    text = _decode_text(raw)
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise RequestError.single(
            "body", "json", f"body is not valid JSON: {error.msg} at line {error.lineno} column {error.colno}"
        ) from None
    except RecursionError:
        raise RequestError.single("body", "json", "body is nested too deeply") from None
    except ValueError:  # json.loads reads integers of up to sys.get_int_max_str_digits() digits
        raise RequestError.single(
            "body",
            "json",
            f"body has a number of more than {sys.get_int_max_str_digits()} digits, longer than this server reads",
        ) from None


def _json_type_name(value: Any) -> str:
    names = {list: "array", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def decode_body(body: Any, content_type: str | None, policy: RequestPolicy) -> GenerationRequest:
    """Turn the body TorchServe hands over into a request.

    TorchServe pre-decodes JSON (dict/list/str/number) and text (str); what it could not decode
    arrives as raw bytes. A ``text/*`` body is the prompt alone. A body with no Content-Type (as
    TorchServe's own diffusers example and gRPC clients send it) is JSON when it starts with ``{`` or
    ``[``, else the prompt; everything else must be a JSON object of request fields.
    """
    media_type = (content_type or "").split(";")[0].strip().lower()
    is_text = media_type.startswith(TEXT_CONTENT_PREFIX)
    if isinstance(body, (bytes, bytearray)):
        if not body.strip():
            raise RequestError.single(
                "body",
                "required",
                'body is empty (or JSON null): send a JSON object such as {"prompt": "a red circle"}',
            )
        if is_text:
            body = _decode_text(body)
        elif media_type:
            body = _parse_json(body)
        else:
            body, is_text = _json_or_prompt(body)
    if is_text and isinstance(body, str):
        return validate_fields({"prompt": body}, policy, strict=True)
    fields = json_fields(body, "a JSON object of request fields (or a text/plain prompt)")
    return validate_fields(fields, policy, strict=True)


def json_fields(body: Any, expected: str = "a JSON object of request fields") -> dict[str, Any]:
    """The fields of a JSON object body, pre-decoded or raw (parsed as UTF-8 JSON)."""
    if isinstance(body, (bytes, bytearray)):
        if not body.strip():
            raise RequestError.single("body", "required", f"body is empty (or JSON null): send {expected}")
        body = _parse_json(body)
    if not isinstance(body, dict):
        raise RequestError.single("body", "object", f"body must be {expected}, got a JSON {_json_type_name(body)}")
    return body


def _json_or_prompt(raw: bytes | bytearray) -> tuple[Any, bool]:
    """A body sent without a Content-Type: JSON when it starts with ``{`` or ``[`` (so a mistyped
    JSON object gets its 400), else its text as the prompt."""
    text = _decode_text(raw)
    if text.lstrip().startswith(("{", "[")):
        return _parse_json(raw), False
    return text, True


# Form fields that carry files, not text.
FILE_FIELDS = frozenset({"image", "mask"})
# Form fields that carry lists or objects, as JSON text.
JSON_FIELDS = (
    "loras",
    "controlnets",
    "cache",
    "skip_guidance_layers",
    *CUSTOM_SCHEDULE_FIELDS,
    *SIZE_CONDITIONING_FIELDS,
)


def form_text(fields: dict[str, Any]) -> dict[str, Any]:
    """Form or query fields, which arrive as text or bytes per field, as text (files as bytes); the
    list and object fields parsed from their JSON text, the one place a form's JSON is read (text that is no
    JSON stays, for the field's own error); the control images' file parts
    (``controlnets.<index>.image``) in their ControlNet entries."""
    files = {name: value for name, value in fields.items() if CONTROL_FILE.fullmatch(name)}
    text = {
        name: _decode_text(value) if isinstance(value, (bytes, bytearray)) and name not in FILE_FIELDS else value
        for name, value in fields.items()
        if name not in files
    }
    for name in JSON_FIELDS:
        if isinstance(text.get(name), str):
            text[name] = _json_or_text(text[name])
    return _with_control_files(text, files) if files else text


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def _with_control_files(fields: dict[str, Any], files: dict[str, Any]) -> dict[str, Any]:
    """Each ``controlnets.<index>.image`` file part as the image of ControlNet entry ``index``."""
    entries = fields.get("controlnets")
    if isinstance(entries, str):
        return fields  # no JSON: the controlnets field's own error says why
    for name, data in files.items():
        index = int(CONTROL_FILE.fullmatch(name).group(1))  # type: ignore[union-attr]  # matched above
        if not isinstance(entries, list) or index >= len(entries) or not isinstance(entries[index], dict):
            message = f"the file part {name} needs a controlnets entry {index} to be the image of"
            raise RequestError([FieldError(name, "no_controlnet", message, nested=True)])
        entries[index] = {**entries[index], "image": data}
    return {**fields, "controlnets": entries}


def decode_form(fields: dict[str, Any], policy: RequestPolicy) -> GenerationRequest:
    """Validate form or query fields."""
    return validate_fields(form_text(fields), policy, strict=False)
