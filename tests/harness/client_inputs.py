"""Hypothesis strategies of what a client can send to the inference API: request fields holding any
JSON value, JSON texts with every escape and number spelling, raw bodies, Content-Type headers and
form fields. The unit fuzzing tests hand them to the handler as TorchServe would; the integration
ones send them over HTTP."""

from __future__ import annotations

import codecs
import json
import math
from typing import Any, get_args

import hypothesis.strategies as st
from PIL import Image

from handler.api.request import GenerationRequest
from handler.config import MAX_SEED, OutputFormat, RequestLimits, ResponseFormat, SchedulerName
from tests.harness.images import png_base64

FIELDS = tuple(GenerationRequest.model_fields)


# Input images as JSON carries them: a picture, and a mask transparent in one corner.
PICTURE = png_base64(Image.new("RGB", (64, 64), (200, 30, 30)))
MASK = png_base64(Image.new("RGBA", (64, 64), (0, 0, 0, 0)).crop((0, 0, 64, 64)))
BASE_FIELDS = {"prompt": "a red circle", "num_inference_steps": 2}

# Every code point, lone surrogates included: JSON carries them as \ud800 escapes.
TEXT = st.text(st.characters(), max_size=30)
INTEGERS = st.integers() | st.sampled_from(
    # 10**4299 has 4300 digits, the most json.loads reads
    [2**31, MAX_SEED, MAX_SEED + 1, 2**63, -(2**63) - 1, 2**64, 10**100, -(10**300), 10**4299]
)
FLOATS = st.floats() | st.sampled_from([-0.0, 1e308, -1e308, 5e-324, math.inf, -math.inf, math.nan])
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | INTEGERS | FLOATS | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)
UNKNOWN_NAMES = st.sampled_from(
    [
        "steps",
        "Prompt",
        "prompt ",
        "body",
        "data",
        "__proto__",
        "a,b:c|#d",
        "x\n[METRICS]sd_images_total.images:1|#model_name:m",
    ]
) | TEXT.filter(lambda name: name not in FIELDS)


def boundary_values(limits: RequestLimits) -> dict[str, list[Any]]:
    """Per field: values at and just past its rules, and the wrong types clients send. Valid ones
    are cheap to generate (a long side only with a short one)."""
    chars, steps, images = limits.max_prompt_chars, limits.max_inference_steps, limits.max_images_per_request
    texts = [
        "a red circle",
        "",
        " \t\n",
        "\u3000",
        "x" * chars,
        "x" * (chars + 1),
        "\ud800",
        "a\udfffb",
        "\U0001f600",
        "\x00",
        "ddim",
    ]
    sides = [
        0,
        8,
        limits.min_side - 8,
        limits.min_side,
        limits.min_side + 1,
        limits.min_side + 8,
        limits.max_side,
        limits.max_side + 8,
        -limits.min_side,
        float(limits.min_side),
        str(limits.min_side),
        True,
    ]
    return {
        "prompt": texts,
        "negative_prompt": [None, *texts],
        "prompt_2": [None, *texts],
        "negative_prompt_2": [None, "", "blurry", "\ud800"],
        "prompt_3": [None, "", "a blue square", "x" * (chars + 1)],
        "negative_prompt_3": [None, "", "blurry"],
        "clip_skip": [None, 0, 1, 11, 12, -1, 1.0, "1", True, 10**12],
        "num_inference_steps": [0, 1, 2, steps, steps + 1, -1, 2.0, 2.5, "2", True, 10**12],
        "guidance_scale": [
            0,
            -0.0,
            1,
            7.5,
            limits.max_guidance_scale,
            limits.max_guidance_scale + 1e-9,
            -1e-300,
            math.nan,
            math.inf,
            1e308,
            "7.5",
            True,
        ],
        "guidance_rescale": [0, 0.0, 0.7, 1, 1.0000001, -0.1, math.nan, math.inf, "0.7", True, None],
        "skip_guidance_layers": [None, [7, 8, 9], [0], [23], [24], [], [-1], [7, 7], "[7]", [7.0], [True], 7],
        "skip_layer_guidance_scale": [None, 0, 2.8, limits.max_guidance_scale + 1, -1, math.nan, "2.8", True],
        "skip_layer_guidance_start": [None, 0, 0.01, 0.5, 1, 1.5, -0.1, math.inf],
        "skip_layer_guidance_stop": [None, 0, 0.2, 0.5, 1, 1.0000001, "0.2"],
        "original_size": [None, [1024, 1024], [0, 16384], [16385, 1], [1024], [-1, 8], "[1024, 1024]", [1.5, 2]],
        "target_size": [None, [64, 64], [64, 64, 64], [True, 1]],
        "crops_coords_top_left": [None, [0, 0], [8, 16], [0, -8]],
        "negative_original_size": [None, [512, 512], []],
        "negative_target_size": [None, [512, 512], [0, 0]],
        "negative_crops_coords_top_left": [None, [0, 0], [4]],
        "seed": [None, 0, -1, MAX_SEED, MAX_SEED + 1, 1.0, "1", True],
        "width": sides,
        "height": sides,
        "num_images_per_prompt": [0, 1, 2, images, images + 1, -1, 1.0, "1", True],
        "scheduler": [*get_args(SchedulerName), "DDIM", " ddim", "lcm", "", None, 0],
        "timesteps": [None, [999, 500, 20], [999], [20, 500], [1000], [0], [], [-1], [999.0], "[999]", [True], 999],
        "sigmas": [None, [14.6, 2.0, 0.0], [1.0, 0.5], [2.0], [0.5, 0.0], [1.0, 1.0], [], [-0.1], "[1]", [math.inf]],
        "eta": [0, 0.0, 0.5, 1, 1.0000001, -0.1, math.nan, "0.5", True, None],
        "output_format": [*get_args(OutputFormat), "PNG", "gif", "", None],
        "response_format": [*get_args(ResponseFormat), "Image", "base64", "", None],
        "stream": [False, True, 0, 1, "true", None],
        "output_compression": [None, 0, 50, 100, 101, -1, 50.5, "50", True],
        "partial_images": [0, 1, 3, 4, -1, 1.0, "1", True],
        "image": [
            None,
            PICTURE,
            PICTURE[: len(PICTURE) // 2],
            PICTURE[:-41],
            "",
            "data:image/png;base64," + PICTURE,
            1,
        ],
        "mask": [None, MASK, PICTURE, MASK[:-8], ""],
        "strength": [0, 0.5, 1, 1.0000001, -1, math.nan, "0.5", True, None],
        "loras": [
            [],
            [{"name": "outline"}],
            [{"name": "../outline"}],
            [{"name": "outline", "scale": math.inf}],
            [{"name": "outline", "scale": 1e9}],
            [{"name": "x"}, {"name": "x"}],
            [{"name": "/etc/passwd"}],
            "outline",
            None,
        ],
        "controlnets": [
            [],
            [{"name": "shapes-mask", "image": PICTURE}],
            [{"name": "shapes-mask", "image": PICTURE, "preprocess": "canny", "low_threshold": 300}],
            [{"name": "shapes-mask", "image": PICTURE, "start": 0.6, "end": 0.4}],
            [{"name": "shapes-mask", "image": PICTURE, "scale": math.inf}],
            [{"name": "shapes-mask", "image": PICTURE, "scale": -1}],
            [{"name": "shapes-mask", "image": PICTURE[:-41]}],
            [{"name": "shapes-mask"}],
            [{"name": "../shapes-mask", "image": PICTURE}],
            [{"name": "shapes-mask", "image": PICTURE}] * 4,
            "shapes-mask",
            None,
        ],
        "cache": [
            {"mode": "off"},
            {"mode": "deep"},
            {"mode": "deep", "interval": 1, "branch": 0},
            {"mode": "deep", "interval": 10},
            {"mode": "deep", "interval": 11},
            {"mode": "deep", "interval": 0},
            {"mode": "deep", "branch": 99},
            {"mode": "deep", "branch": -1},
            {"mode": "deep", "interval": 2.5},
            {"mode": "first_block", "threshold": 0.1},
            {"mode": "first_block", "threshold": 0},
            {"mode": "first_block", "threshold": 0.5},
            {"mode": "first_block", "threshold": 0.51},
            {"mode": "first_block", "threshold": -1},
            {"mode": "first_block", "threshold": math.nan},
            {"mode": "first_block", "threshold": "0.2"},
            {"mode": "deep", "extra": 1},
            "deep",
            None,
        ],
    }


def request_fields(limits: RequestLimits) -> st.SearchStrategy[dict[str, Any]]:
    """A JSON object of request fields: any of the known ones with boundary or arbitrary JSON
    values, sometimes unknown ones; or a valid request with one field set so."""
    values = {name: st.sampled_from(pool) | JSON_VALUES for name, pool in boundary_values(limits).items()}
    anything = st.builds(
        lambda known, unknown: {**unknown, **known},
        st.fixed_dictionaries({}, optional={name: values[name] for name in FIELDS}),
        st.just({}) | st.dictionaries(UNKNOWN_NAMES, JSON_VALUES, max_size=2),
    )
    one_off = st.one_of(
        *(values[name].map(lambda value, name=name: {**BASE_FIELDS, name: value}) for name in FIELDS),
        JSON_VALUES.map(lambda value: {**BASE_FIELDS, "steps": value}),
    )
    return anything | one_off


# JSON texts, written out: every escape JSON has (and a few it has not), every spelling of a number.
STRING_PIECES = st.one_of(
    st.characters(exclude_characters='"\\'),  # raw control characters (not JSON) and lone surrogates included
    st.sampled_from(
        ['\\"', "\\\\", "\\/", "\\b", "\\f", "\\n", "\\r", "\\t", "\\u0000", "\\ud800", "\\udfff", "\\ud83d\\ude00"]
    ),
    st.integers(0, 0xFFFF).map("\\u{:04x}".format),
    st.integers(0, 0xFFFF).map("\\u{:04X}".format),
    st.sampled_from(["\\x41", "\\u12", "\\", "\\U0001F600", "\\a"]),  # not JSON
)
JSON_STRINGS = st.lists(STRING_PIECES, max_size=10).map(lambda pieces: '"' + "".join(pieces) + '"')
JSON_NUMBERS = (
    INTEGERS.map(str)
    | st.floats(allow_nan=False, allow_infinity=False).map(repr)
    | st.sampled_from(
        [
            "-0",
            "-0.0",
            "0e0",
            "1E+2",
            "1e309",
            "-1e999",
            "2.5e-400",
            "NaN",
            "Infinity",
            "-Infinity",
            "01",
            "1.",
            ".5",
            "+1",
            "0x10",
            "9" * 4301,
        ]
    )
)
JSON_KEYS = st.sampled_from([json.dumps(name) for name in FIELDS]) | JSON_STRINGS


def _object(members: list[tuple[str, str]]) -> str:
    return "{" + ",".join(f"{key}:{value}" for key, value in members) + "}"


JSON_TEXTS = st.recursive(
    st.sampled_from(["true", "false", "null"]) | JSON_NUMBERS | JSON_STRINGS,
    lambda inner: (
        st.lists(inner, max_size=3).map(lambda items: "[" + ",".join(items) + "]")
        | st.lists(st.tuples(JSON_KEYS, inner), max_size=4).map(_object)
    ),
    max_leaves=10,
)
WHITESPACE = st.sampled_from(["", " ", "\n", "\t", "\r\n"])
JSON_DOCUMENTS = st.tuples(
    WHITESPACE, st.lists(st.tuples(JSON_KEYS, JSON_TEXTS), max_size=6).map(_object) | JSON_TEXTS, WHITESPACE
).map("".join)


def _encoded(text: str) -> st.SearchStrategy[bytes]:
    """``text`` as a client may encode it: UTF-8 (not UTF-8 where it has lone surrogates), with a
    byte order mark, UTF-16, or cut off halfway."""
    data = text.encode("utf-8", "surrogatepass")
    return st.sampled_from(
        [data, codecs.BOM_UTF8 + data, text.encode("utf-16", "surrogatepass"), data[: len(data) // 2]]
    )


RAW_BODIES = st.one_of(
    JSON_DOCUMENTS.flatmap(_encoded),
    st.builds(lambda fields: json.dumps(fields).encode(), request_fields(RequestLimits())),
    TEXT.map(lambda text: text.encode("utf-8", "surrogatepass")),
    st.binary(max_size=64),
    st.sampled_from([b"", b" \r\n", b"null", b"{}", b"[" * 3000 + b"]" * 3000, b"\xff\xfe", b"\x00"]),
)

JSON_CONTENT_TYPES = ("application/json", "application/json; charset=utf-8", None, "application/octet-stream")
CONTENT_TYPES = (
    *JSON_CONTENT_TYPES,
    "",
    "application/json;charset=UTF-8",
    "Application/JSON",
    "application/json ; charset=latin-1",
    "text/plain",
    "text/plain; charset=utf-8",
    "text/html",
    "text/csv; charset=iso-8859-1",
    "text",
    "textual/json",
    "multipart/form-data",
    "application/xml",
    "image/png",
    "*/*",
    ";",
    "; charset=utf-8",
    "json",
)
# What an HTTP header value can carry (netty reads header bytes as ISO-8859-1 and trims them).
HEADER_TEXT = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=30
).map(str.strip)


def frontend_decodes_form(content_type: str) -> bool:
    """Whether TorchServe's frontend (netty's HttpPostRequestDecoder) decodes a body of this
    Content-Type into form fields instead of passing it on as the body: multipart/form-data with a
    boundary parameter, or application/x-www-form-urlencoded. It answers a malformed form itself."""
    lowered = content_type.lower()
    return (
        lowered.startswith("multipart/form-data")
        and "boundary" in lowered
        or lowered.split(";")[0] == "application/x-www-form-urlencoded"
    )


# The Content-Type header of a body (None: no header); form types are in FORM_PARTS.
CONTENT_TYPE_HEADERS = (st.sampled_from(CONTENT_TYPES) | HEADER_TEXT).filter(
    lambda value: value is None or not frontend_decodes_form(value)
)

FORM_NAMES = st.sampled_from([*FIELDS, "body", "data"]) | st.text(max_size=12)
FORM_VALUES = st.one_of(
    st.sampled_from([value for pool in boundary_values(RequestLimits()).values() for value in pool]).map(
        lambda value: value if isinstance(value, str) else json.dumps(value)
    ),
    JSON_VALUES.map(lambda value: json.dumps(value, ensure_ascii=False)),
    TEXT,
).map(lambda text: text.encode("utf-8", "surrogatepass")) | st.binary(max_size=32)
UPLOAD_CONTENT_TYPES = st.none() | st.sampled_from([value for value in CONTENT_TYPES if value])
# A form field: (name, value, Content-Type of a file upload or None for a plain field).
FORM_FIELDS = st.tuples(FORM_NAMES, FORM_VALUES, UPLOAD_CONTENT_TYPES)
# Any form fields, or a valid form with more fields.
FORM_PARTS = st.lists(FORM_FIELDS, max_size=5) | st.lists(FORM_FIELDS, max_size=2).map(
    lambda parts: [(name, str(value).encode(), None) for name, value in BASE_FIELDS.items()] + parts
)
