"""Input images of image-to-image and inpainting requests, in the native API: how they are read
(base64, data URLs, form file parts), sized, turned into diffusers' mask, and every way they are
refused by field and rule, a decompression bomb before any pixel is decoded."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from dataclasses import replace

import numpy as np
import pytest
from PIL import Image

from handler.api.bodies import decode_body, decode_form
from handler.api.errors import RequestError
from handler.api.input_image import fit
from handler.api.policy import RequestPolicy
from handler.config import FamilyRules, RequestDefaults, RequestLimits

POLICY = RequestPolicy(RequestLimits(max_side=512, max_pixels=512 * 256), RequestDefaults(width=64, height=64))


def encoded(image: Image.Image, image_format: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=image_format)
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def rgba(size=(96, 64), hole=True) -> Image.Image:
    """A picture whose middle is transparent (an OpenAI-style mask where ``hole``)."""
    pixels = np.full((size[1], size[0], 4), 255, dtype=np.uint8)
    pixels[..., :3] = 200
    if hole:
        pixels[16:48, 32:64, 3] = 0
    return Image.fromarray(pixels)


def errors_of(body: dict, policy: RequestPolicy = POLICY) -> list[tuple[str, str]]:
    with pytest.raises(RequestError) as caught:
        decode_body({"prompt": "p", **body}, "application/json", policy)
    return [(error.field, error.rule) for error in caught.value.errors]


def png_header_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims a size its (empty) data does not hold: a decompression bomb's shape."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunks = b""
    for kind, data in ((b"IHDR", header), (b"IDAT", zlib.compress(b"\0" * 64)), (b"IEND", b"")):
        chunks += struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return b"\x89PNG\r\n\x1a\n" + chunks


def test_an_image_in_json_is_base64_or_a_data_url_and_sets_the_size():
    data = encoded(rgba(hole=False))
    for value in (b64(data), "data:image/png;base64," + b64(data)):
        request = decode_body({"prompt": "p", "image": value, "strength": 0.5}, "application/json", POLICY)
        assert request.image is not None and request.image.mode == "RGB" and request.image.size == (96, 64)
        assert (request.width, request.height, request.strength) == (96, 64, 0.5)
        assert request.parameters()["strength"] == 0.5 and "image" not in request.parameters()


def test_a_given_size_wins_and_a_large_image_is_fitted_to_the_limits():
    image = b64(encoded(Image.new("RGB", (2000, 1000))))
    request = decode_body({"prompt": "p", "image": image, "width": 128, "height": 64}, "application/json", POLICY)
    assert (request.width, request.height) == (128, 64)
    request = decode_body({"prompt": "p", "image": image}, "application/json", POLICY)
    assert (request.width, request.height) == (512, 256)  # within 512 per side and 512x256 pixels
    assert request.width * request.height <= POLICY.limits.max_pixels


def test_form_file_parts_arrive_as_bytes():
    fields = {"prompt": b"p", "image": bytearray(encoded(rgba())), "mask": bytearray(encoded(rgba())), "strength": "1"}
    request = decode_form(fields, POLICY)
    assert request.image is not None and request.mask is not None and request.strength == 1.0


def test_a_mask_is_transparent_where_repainted_and_becomes_diffusers_white():
    request = decode_body(
        {"prompt": "p", "image": b64(encoded(rgba(hole=False))), "mask": b64(encoded(rgba()))},
        "application/json",
        POLICY,
    )
    assert request.mask is not None and request.mask.mode == "L"
    mask = np.asarray(request.mask)
    assert mask[32, 48] == 255 and mask[0, 0] == 0


def test_text_to_image_requests_report_no_strength():
    request = decode_body({"prompt": "p"}, "application/json", POLICY)
    assert request.image is None and "strength" not in request.parameters()


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"image": "not base64!"}, [("image", "base64")]),
        ({"image": 7}, [("image", "image_type")]),
        ({"image": b64(b"GIF89a not a png")}, [("image", "image_format")]),
        ({"image": b64(encoded(Image.new("RGB", (64, 64))))[:-41]}, [("image", "base64")]),
        ({"image": b64(encoded(Image.new("RGB", (64, 64)))[:-30])}, [("image", "image_corrupt")]),
        ({"image": b64(encoded(Image.new("I;16", (64, 64))))}, [("image", "image_mode")]),
        ({"mask": b64(encoded(rgba()))}, [("mask", "needs_image")]),
        ({"image": b64(encoded(rgba())), "mask": b64(encoded(Image.new("RGB", (96, 64))))}, [("mask", "mask_alpha")]),
        ({"image": b64(encoded(rgba())), "mask": b64(encoded(rgba((64, 64))))}, [("mask", "mask_size")]),
        ({"image": b64(encoded(rgba())), "strength": 0}, [("strength", "greater_than")]),
        ({"image": b64(encoded(rgba())), "strength": 1.5}, [("strength", "less_than_equal")]),
        ({"image": b64(encoded(rgba())), "strength": float("nan")}, [("strength", "finite_number")]),
        ({"strength": 0.5}, [("strength", "needs_image")]),
        ({"image": b64(encoded(rgba())), "strength": 0.1, "num_inference_steps": 4}, [("strength", "no_steps")]),
        ({"image": "not base64!", "mask": b64(encoded(rgba()))}, [("image", "base64")]),
    ],
)
def test_a_bad_input_image_is_refused_naming_the_field_and_rule(body, expected):
    assert errors_of(body) == expected


def webp_header_claiming(width: int, height: int) -> bytes:
    """An extended WebP whose canvas claims ``width`` x ``height`` (Pillow's opener would allocate it)."""
    vp8x = b"\x00" * 4 + (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    return (
        b"RIFF" + (4 + 8 + len(vp8x)).to_bytes(4, "little") + b"WEBP" + b"VP8X" + len(vp8x).to_bytes(4, "little") + vp8x
    )


def test_a_webp_canvas_is_checked_before_pillow_opens_it():
    assert errors_of({"image": b64(webp_header_claiming(16_000, 16_000))}) == [("image", "image_too_large")]
    real = encoded(Image.new("RGB", (96, 64)), "WEBP")
    assert decode_body({"prompt": "p", "image": b64(real)}, "application/json", POLICY).image.size == (96, 64)


def test_a_form_text_part_may_carry_base64_and_a_mask_may_use_a_transparency_key():
    keyed = Image.new("RGB", (96, 64), (255, 255, 255))
    keyed.paste((0, 0, 0), (32, 16, 64, 48))
    buffer = io.BytesIO()
    keyed.save(buffer, format="PNG", transparency=(0, 0, 0))
    fields = {"prompt": b"p", "image": bytearray(b64(encoded(rgba())).encode()), "mask": bytearray(buffer.getvalue())}
    request = decode_form(fields, POLICY)
    assert request.mask is not None and np.asarray(request.mask)[32, 48] == 255


def test_a_decompression_bomb_is_refused_from_its_header_before_decoding():
    """The header claims 7.5 GB of pixels the body does not hold: decoding would fail or allocate."""
    assert errors_of({"image": b64(png_header_claiming(50_000, 50_000))}) == [("image", "image_too_large")]
    assert errors_of({"image": b64(png_header_claiming(3_000, 3_000))}) == [("image", "image_too_large")]
    small = replace(POLICY, limits=POLICY.limits.model_copy(update={"max_input_pixels": 64 * 64}))
    assert errors_of({"image": b64(encoded(rgba()))}, small) == [("image", "image_too_large")]


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        ((64, 64), (64, 64)),
        ((100, 70), (96, 64)),
        ((2000, 1000), (512, 256)),
        ((1000, 1000), (360, 360)),
        ((10, 10), (64, 64)),
        ((513, 8), (512, 64)),
    ],
)
def test_fit_keeps_the_aspect_within_the_limits(size, expected):
    assert fit(*size, min_side=64, max_side=512, max_pixels=512 * 256) == expected


def test_an_input_image_runs_the_steps_its_familys_img2img_pipeline_rounds_to():
    """SD's get_timesteps runs int(steps x strength) steps, SD 3's rounds the skipped ones down: 2
    steps at strength 0.3 is no step for SD (a 400) and one for SD 3, whose input image's size is
    also fitted to its grid and to the largest side its transformer takes."""
    sd3 = replace(
        POLICY,
        defaults=RequestDefaults(width=64, height=64, scheduler="flow_match_euler"),
        rules=FamilyRules("SD 3.x", ("flow_match_euler",), "flow_match_euler", 16, "start", max_side=256),
    )
    body = {"prompt": "x", "image": b64(encoded(rgba((64, 64), hole=False))), "num_inference_steps": 2, "strength": 0.3}
    assert errors_of(body) == [("strength", "no_steps")]
    assert decode_body(body, "application/json", sd3).strength == 0.3
    large = decode_body({"prompt": "x", "image": b64(encoded(rgba((600, 200), hole=False)))}, "application/json", sd3)
    assert (large.width, large.height) == (256, 80)
