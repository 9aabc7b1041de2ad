"""The service's two loops over a stand-in engine: one response per request, jobs of one shape in
one forward, failures confined to their request, out of memory split and retried, decode retried
per image then in tiles, streaming, clients that leave, deadline slack, and the same metrics in
both modes."""

from __future__ import annotations

import base64
import io
import json
import logging
import threading

import pytest
import torch
from PIL import Image

from handler.adapters.library import Busy, EntryError
from handler.api.protocol import NSFW_HEADER, STREAM_CONTENT_TYPE, IncomingRequest
from handler.engine.jobs import DenoiseJob
from handler.engine.profiling import StepsProfiler
from handler.service import loops
from tests.harness.stand_ins import SHAPE, Clock, RecordingSink, SolidColorEngine, batch, make_service, run


def body(**fields) -> IncomingRequest:
    return IncomingRequest({"prompt": "p", "seed": 1, "num_inference_steps": 3, **fields}, "application/json")


def png_base64(side: int = 8) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (side, side), "white").save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def grey(data: bytes) -> int:
    return Image.open(io.BytesIO(data)).getpixel((0, 0))[0]


# Dynamic batching: one call, every request answered.


def test_requests_of_one_shape_share_each_forward_whatever_their_steps_scheduler_and_guidance():
    engine = SolidColorEngine()
    service = make_service(engine, streaming=False)
    responses = batch(
        service,
        body(seed=10, num_inference_steps=2),
        body(seed=20, num_images_per_prompt=2, response_format="json", scheduler="euler_a", guidance_scale=1.0),
        body(seed=30, num_inference_steps=4, width=128),
    )
    assert [response.status for response in responses] == [200, 200, 200]
    assert grey(responses[0].body) == 10 and grey(responses[2].body) == 30
    payload = json.loads(responses[1].body)
    assert [grey(base64.b64decode(image)) for image in payload["images"]] == [20, 21]
    assert payload["seed"] == 20 and payload["batch"] == {"requests": 3, "max_step_images": 3}
    assert payload["nsfw_content_detected"] is None
    assert {"admission_s", "denoise_s", "vae_decode_s", "encode_s"} == set(payload["timings"])
    assert responses[1].headers == {"X-Seed": "20"} and responses[1].content_type == "application/json"
    # the two 64x64 jobs share each forward; the 128x64 job takes its own
    assert engine.steps[:2] == [["p", "p"], ["p"]] or engine.steps[:2] == [["p"], ["p", "p"]]
    assert sum(len(prompts) for prompts in engine.steps) == 2 + 3 + 4


@pytest.mark.parametrize("field", ["loras", "controlnets"])
def test_an_adapter_that_cannot_load_now_is_503_and_one_that_cannot_be_served_400_naming_the_field(field, monkeypatch):
    engine = SolidColorEngine()
    library = getattr(engine, field)
    refusals = iter([Busy("does not fit in device memory now"), EntryError(f"unknown_{field[:-1]}", "no such one")])

    def refuse(*args):
        raise next(refusals)

    monkeypatch.setattr(library, "acquire", refuse)
    choice = {"name": "outline"} if field == "loras" else {"name": "edges", "image": png_base64()}
    busy, unknown, plain = batch(
        make_service(engine, streaming=False), body(**{field: [choice]}), body(**{field: [choice]}), body(seed=7)
    )
    assert busy.status == 503 and busy.headers["Retry-After"] == "1" and b"device memory" in busy.body
    assert unknown.status == 400 and json.loads(unknown.body)["errors"][0]["field"] == field
    assert plain.status == 200 and grey(plain.body) == 7


def test_a_bad_request_fails_alone():
    responses = batch(
        make_service(streaming=False),
        body(seed=5),
        body(width=100),
        IncomingRequest(bytearray(b"{"), "application/json"),
    )
    assert [response.status for response in responses] == [200, 400, 400]
    assert json.loads(responses[1].body)["errors"][0]["field"] == "width"
    assert grey(responses[0].body) == 5


def test_a_failing_step_fails_only_the_requests_that_took_it():
    responses = batch(make_service(streaming=False), body(prompt="explode"), body(width=128, seed=7), body(seed=8))
    assert [response.status for response in responses] == [500, 200, 500]
    assert "denoising failed: RuntimeError: boom" in json.loads(responses[0].body)["message"]
    assert grey(responses[1].body) == 7


def test_a_request_that_fails_at_admission_fails_alone_with_its_status():
    engine = SolidColorEngine()
    responses = batch(make_service(engine, streaming=False), body(prompt="explode at start"), body(seed=3))
    assert [response.status for response in responses] == [500, 200]
    assert "admission failed: RuntimeError: text encoder broke" in json.loads(responses[0].body)["message"]
    assert engine.starts == [["explode at start", "p"], ["explode at start"], ["p"]], "together, then each alone"


def test_requests_admitted_together_are_started_in_one_call():
    engine = SolidColorEngine()
    responses = batch(make_service(engine, streaming=False), body(seed=1), body(seed=2, width=128), body(seed=3))
    assert [response.status for response in responses] == [200] * 3
    assert engine.starts == [["p", "p", "p"]]


def test_an_unexpected_decoding_error_fails_only_that_request(monkeypatch):
    import handler.api.protocol

    real = handler.api.protocol.decode_body

    def buggy(body, content_type, policy):
        if body.get("prompt") == "bug":
            raise TypeError("unexpected")
        return real(body, content_type, policy)

    monkeypatch.setattr(handler.api.protocol, "decode_body", buggy)
    responses = batch(make_service(streaming=False), body(seed=3), body(prompt="bug"))
    assert [response.status for response in responses] == [200, 500]
    assert "decoding failed: TypeError" in json.loads(responses[1].body)["message"]


def test_fields_in_both_body_and_form_are_refused_and_form_fields_alone_work():
    both, form = batch(
        make_service(streaming=False),
        IncomingRequest({"prompt": "x"}, "application/json", {"seed": "1"}),
        IncomingRequest(None, None, {"prompt": "x", "seed": "9", "num_inference_steps": "2"}),
    )
    assert both.status == 400 and json.loads(both.body)["errors"][0]["rule"] == "one_source"
    assert form.status == 200 and form.headers["X-Seed"] == "9"


def test_out_of_memory_halves_the_forward_until_it_fits_and_lowers_the_cap():
    sink, engine = RecordingSink(), SolidColorEngine(out_of_memory_above_images=1)
    service = make_service(engine, sink, streaming=False)
    responses = batch(service, body(seed=1), body(seed=2), body(seed=3))
    assert [response.status for response in responses] == [200, 200, 200]
    assert [grey(response.body) for response in responses] == [1, 2, 3]
    assert [len(prompts) for prompts in engine.steps[:5]] == [3, 1, 2, 1, 1]
    assert sink.values("sd_oom_retries_total") == [1, 1] and service.profile.cap(SHAPE) == 2  # rows: one guided image
    assert {labels for name, _, labels in sink.records if name == "sd_oom_retries_total"} == {("step",)}


class PaddingEngine(SolidColorEngine):
    """Pads a forward's rows to row counts as a compiled denoiser does (the step engine's rule)."""

    row_counts = (2, 4, 8, 16)


def test_a_padded_forward_out_of_memory_caps_the_shape_by_the_rows_it_ran():
    """Five guided images (10 rows, padded to 16) do not fit: the cap is 8 rows, half of what ran, so
    the retried halves (4 and 6 rows, padded to 4 and 8) go through and later forwards carry 4 images."""
    engine = PaddingEngine(out_of_memory_above_images=4)
    service = make_service(engine, streaming=False)
    responses = batch(service, *(body(seed=seed) for seed in range(5)))
    assert [response.status for response in responses] == [200] * 5
    assert [len(prompts) for prompts in engine.steps[:3]] == [5, 2, 3] and service.profile.cap(SHAPE) == 8
    assert max(len(prompts) for prompts in engine.steps[3:]) == 4


def test_only_a_request_too_large_alone_fails_and_the_next_like_it_is_refused_at_admission():
    engine = SolidColorEngine(out_of_memory_above_images=2)
    service = make_service(engine)
    responses = batch(service, body(seed=1), body(prompt="big", num_images_per_prompt=3))
    assert [response.status for response in responses] == [200, 507]
    message = json.loads(responses[1].body)["message"]
    assert "3 image(s) of 64x64 even alone" in message
    forwards = len(engine.steps)
    (refused,) = run(service, {0: {"again": body(num_images_per_prompt=3)}})["again"]
    assert refused.first and refused.final and refused.status == 507 and len(engine.steps) == forwards


def test_decode_out_of_memory_retries_image_by_image_then_in_tiles():
    sink, engine = RecordingSink(), SolidColorEngine(decode_out_of_memory_above_images=1)
    responses = batch(
        make_service(engine, sink, streaming=False),
        body(seed=1, num_images_per_prompt=2, response_format="json"),
        body(seed=5),
    )
    assert [response.status for response in responses] == [200, 200]
    assert engine.decodes[-4:] == [(3, False), (1, False), (1, False), (1, False)]
    pair = [grey(base64.b64decode(image)) for image in json.loads(responses[0].body)["images"]]
    assert pair == [1, 2] and grey(responses[1].body) == 5
    assert sink.values("sd_pipeline_calls_total") == [1] and sink.values("sd_images_total") == [3]  # one decode
    engine = SolidColorEngine(decode_out_of_memory_above_images=0)
    responses = batch(make_service(engine, sink, streaming=False), body(seed=1), body(seed=5))
    assert [grey(response.body) for response in responses] == [1, 5]
    assert engine.decodes[-5:] == [(2, False), (1, False), (1, True), (1, False), (1, True)]
    assert len(sink.values("sd_oom_retries_total")) == 1 + 3
    assert {labels for name, _, labels in sink.records if name == "sd_oom_retries_total"} == {("vae_decode",)}


@pytest.mark.parametrize("overlap", [False, True])
def test_images_out_of_memory_together_are_made_one_at_a_time_and_the_retry_is_counted(overlap):
    """The host part of a decode (where a safety checker runs) out of memory, on the stepping
    thread or an encoder thread: every request still gets its images, one retry is counted."""
    sink, engine = RecordingSink(), SolidColorEngine(images_out_of_memory_above=1)
    service = make_service(engine, sink, streaming=False, overlap_encoding=overlap)
    responses = batch(service, body(seed=1, num_images_per_prompt=2, response_format="json"), body(seed=5))
    assert [response.status for response in responses] == [200, 200]
    pair = [grey(base64.b64decode(image)) for image in json.loads(responses[0].body)["images"]]
    assert pair == [1, 2] and grey(responses[1].body) == 5
    assert engine.decodes == [(3, False)] and len(engine.images_made_on) == 1 + 3
    assert [labels for name, value, labels in sink.records if name == "sd_oom_retries_total" and value] == [
        ("postprocess",)
    ]
    assert sink.values("sd_pipeline_calls_total") == [1] and sink.values("sd_images_total") == [3]


@pytest.mark.parametrize("vae_fits", [True, False])
def test_images_that_do_not_fit_the_postprocess_alone_fail_their_requests_with_507_naming_it(vae_fits):
    """Out of memory in the host part of a decode even for one image, after a decode of both
    requests or after the VAE decoded image by image: 507 naming the postprocess, the VAE not run
    again in tiles."""
    engine = SolidColorEngine(decode_out_of_memory_above_images=2 if vae_fits else 1, images_out_of_memory_above=0)
    responses = batch(make_service(engine, streaming=False), body(seed=1), body(seed=2))
    assert [response.status for response in responses] == [507, 507]
    message = json.loads(responses[0].body)["message"]
    assert message == "the accelerator ran out of memory during postprocess (safety checker or watermark, PIL images)"
    assert engine.decodes == ([(2, False)] if vae_fits else [(2, False), (1, False), (1, False)])


def test_a_decode_that_fails_even_in_tiles_fails_only_its_requests():
    engine = SolidColorEngine(decode_out_of_memory_above_images=0, tiles_fail=True)
    service = make_service(engine, streaming=False)
    responses = batch(service, body(seed=1), body(seed=2, width=128))
    assert [response.status for response in responses] == [507, 507]
    assert "ran out of memory during VAE decode" in json.loads(responses[0].body)["message"]


def test_latency_is_recorded_when_the_answer_leaves_with_its_batch():
    sink, clock = RecordingSink(), Clock()
    service = make_service(sink=sink, streaming=False, clock=clock)
    batch(service, body(num_inference_steps=1), body(num_inference_steps=20))
    short, long = sink.values("sd_request_latency_seconds")
    assert short >= long - 0.01, "the short request waited for its batch and its latency says so"
    assert sink.values("sd_request_latency_sla_ratio") == [short / 2.0, long / 2.0]


def test_prompts_are_logged_only_when_configured(caplog):
    with caplog.at_level(logging.DEBUG, logger="handler.service"):
        batch(make_service(streaming=False), body(prompt="private words"), body(prompt="rejected words", width=100))
    assert "private words" not in caplog.text and "rejected words" not in caplog.text
    assert "rejected: width (multiple_of)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="handler.service"):
        batch(make_service(streaming=False, log_prompts=True), body(prompt="shared words"))
    assert "shared words" in caplog.text


def test_stream_is_refused_with_dynamic_batching():
    (response,) = batch(make_service(streaming=False), body(stream=True))
    assert response.status == 400 and "continuousBatching: true" in response.body.decode()


# Continuous batching: one iteration per call.


def test_staggered_requests_with_different_steps_each_get_their_own_image_and_short_ones_leave_first():
    parts = run(
        make_service(),
        {
            0: {"a": body(seed=1, num_inference_steps=12)},
            3: {"b": body(seed=2, num_inference_steps=3)},
            5: {"c": body(seed=3, num_inference_steps=5, width=128)},
        },
    )
    assert all(parts[rid][0].status == 200 and parts[rid][0].content_type == "image/png" for rid in parts)
    assert all(part.body == b"" and not part.final for rid in parts for part in parts[rid][:-1])
    assert parts["a"][0].headers == {"X-Seed": "1"} and parts["a"][1].headers == {}
    assert len(parts["b"]) < len(parts["a"])
    assert [grey(parts[rid][-1].body) for rid in "abc"] == [1, 2, 3]


def test_a_streaming_request_gets_progress_events_then_its_images():
    (first, *rest) = run(make_service(), {0: {"s": body(num_inference_steps=4, stream=True, seed=5)}})["s"]
    assert first.content_type == STREAM_CONTENT_TYPE and first.headers == {"X-Seed": "5"}
    events = [json.loads(line) for part in (first, *rest) for line in part.body.decode().splitlines()]
    assert [event["step"] for event in events[:-1]] == [1, 2, 3]
    assert all(event["event"] == "progress" and event["total_steps"] == 4 for event in events[:-1])
    assert events[-1]["event"] == "done" and events[-1]["seed"] == 5 and len(events[-1]["images"]) == 1


def test_partial_images_put_previews_decoded_from_the_latents_into_progress_lines():
    engine = SolidColorEngine()
    parts = run(make_service(engine), {0: {"s": body(num_inference_steps=6, stream=True, partial_images=2, seed=5)}})
    events = [json.loads(line) for part in parts["s"] for line in part.body.decode().splitlines()]
    previews = {event["step"]: event["images"] for event in events[:-1] if "images" in event}
    assert list(previews) == [2, 4] and all(grey(base64.b64decode(images[0])) == 5 for images in previews.values())
    assert len(engine.decodes) == 3  # two previews and the image


def test_a_bad_request_mid_flight_fails_alone_with_an_ordinary_400():
    parts = run(make_service(), {0: {"good": body(num_inference_steps=4)}, 2: {"bad": body(num_inference_steps=0)}})
    (bad,) = parts["bad"]
    assert bad.final and bad.first and bad.status == 400
    assert json.loads(bad.body)["errors"][0]["field"] == "num_inference_steps"
    assert parts["good"][-1].final and parts["good"][-1].body.startswith(b"\x89PNG")


def test_a_request_whose_client_left_is_dropped_and_counted():
    sink = RecordingSink()
    service = make_service(sink=sink)
    service.iterate({"x": body(num_inference_steps=10), "y": body(num_inference_steps=10)})
    assert set(service.flights) == {"x", "y"}
    service.iterate({"y": IncomingRequest(None)})
    assert set(service.flights) == {"y"} and service.flights["y"].job.step == 2, "x took no further step"
    assert [labels for name, _, labels in sink.records if name == "sd_cancelled_requests_total"] == [("client_gone",)]


@pytest.mark.parametrize("streaming", [False, True])
def test_a_request_that_would_pass_its_time_limit_is_cancelled_with_504_and_its_batchmates_finish(streaming):
    """The profile says a forward takes 0.1 s and the clock moves 1 ms a read: a 0.2 s limit cancels
    a long request after some steps, before the step that would end past it."""
    sink = RecordingSink()
    service = make_service(sink=sink, streaming=streaming, request_timeout_seconds=0.2, clock=Clock())
    traffic = {"long": body(num_inference_steps=100, seed=1), "short": body(num_inference_steps=2, seed=2)}
    if streaming:
        parts = run(service, {0: traffic})
        long, short = parts["long"][-1], parts["short"][-1]
        assert long.final and (long.status == 504) == long.first
    else:
        answers = service.run_batch(traffic)
        long, short = answers["long"], answers["short"]
        assert long.status == 504
    error = json.loads(long.body)
    assert error["type"] == "DeadlineExceeded" and "handler.request_timeout_s" in error["message"]
    assert short.status == 200 and grey(short.body) == 2
    assert [labels for name, _, labels in sink.records if name == "sd_cancelled_requests_total"] == [("deadline",)]
    assert service.flights == {}


def test_a_full_batch_without_a_stream_steps_past_the_budget_until_a_request_finishes():
    """TorchServe lets no request join a full batch, so returning at the budget would only cost a
    round trip; with room for one more, or a streamed request awaiting progress, the call returns."""
    full = make_service(iteration_budget_seconds=0.0, batch_size=2)
    answers = full.iterate({"a": body(num_inference_steps=5), "b": body(num_inference_steps=9)})
    assert answers["a"].final and full.flights["b"].job.step == 5
    room = make_service(iteration_budget_seconds=0.0, batch_size=3)
    room.iterate({"a": body(num_inference_steps=5), "b": body(num_inference_steps=9)})
    assert room.flights["a"].job.step == 1
    streamed = make_service(iteration_budget_seconds=0.0, batch_size=2)
    streamed.iterate({"a": body(num_inference_steps=5, stream=True), "b": body(num_inference_steps=9)})
    assert streamed.flights["a"].job.step == 1


def test_a_grpc_request_is_answered_in_one_part_sharing_its_forwards_with_http_requests():
    """TorchServe 0.12 ends a gRPC call with the first part of its answer: the call holds until the
    gRPC request is done, answering the HTTP requests that finish meanwhile with it."""
    engine = SolidColorEngine()
    service = make_service(engine, iteration_budget_seconds=0.0)
    service.iterate({"h": body(num_inference_steps=20, seed=2)})
    grpc = IncomingRequest(body(num_inference_steps=6, seed=1).body, "application/json", over_grpc=True)
    answers = service.iterate({"h": IncomingRequest(None), "g": grpc, "short": body(num_inference_steps=2, seed=3)})
    assert answers["g"].final and answers["g"].first and grey(answers["g"].body) == 1
    assert answers["short"].final and not answers["h"].final and service.flights["h"].job.step == 1 + 6
    assert all({"p"} == set(prompts) and len(prompts) >= 2 for prompts in engine.steps[1:3]), "shared forwards"


def test_the_queue_gauges_count_requests_images_and_those_left_out_of_a_forward():
    sink = RecordingSink()
    service = make_service(sink=sink, cap_profile=(2,))
    service.profile.seconds[SHAPE] = {2: 0.1, 4: 0.2}  # cap 2 rows: one guided image per forward
    service.iterate({"a": body(num_images_per_prompt=1), "b": body(num_images_per_prompt=3, guidance_scale=1.0)})
    gauges = {name: sink.values(name)[-1] for name in ("sd_in_flight_requests", "sd_in_flight_images")}
    assert gauges == {"sd_in_flight_requests": 2, "sd_in_flight_images": 4}
    assert sink.values("sd_waiting_requests")[-1] == 1, "one of the two waits behind the cap"
    assert {labels for name, _, labels in sink.records if name.startswith("sd_in_flight")} == {("0",)}
    run(service, {0: {"a": IncomingRequest(None), "b": IncomingRequest(None)}})
    assert [sink.values(name)[-1] for name in ("sd_in_flight_requests", "sd_in_flight_images")] == [0, 0]
    assert sink.values("sd_waiting_requests")[-1] == 0


def test_least_slack_runs_first_within_the_profiles_cap():
    clock = Clock()
    service = make_service(clock=clock, cap_profile=(2,))
    service.profile.seconds[SHAPE] = {2: 0.1, 4: 0.2, 8: 0.4}  # per-row time flat: cap 2 rows, one guided image
    assert service.profile.cap(SHAPE) == 2
    service.iterate({"early": body(num_inference_steps=10)})
    clock.now = 5.0
    # arrives later but has far more steps: less slack, so it takes the next step alone
    service.iterate({"early": IncomingRequest(None), "long": body(num_inference_steps=90)})
    early, long = service.flights["early"], service.flights["long"]
    assert long.job.step == 1 and early.job.step == 1
    service.profile.seconds[SHAPE] = {2: 0.1, 4: 0.1, 8: 0.2}  # two images for the price of one: cap 4 rows
    service.iterate({"early": IncomingRequest(None), "long": IncomingRequest(None)})
    assert long.job.step == 2 and early.job.step == 2


def test_a_failure_after_the_status_was_sent_reaches_the_client_as_200_with_a_json_error():
    engine = SolidColorEngine()
    service = make_service(engine, cap_profile=(2,))
    service.profile.seconds[SHAPE] = {2: 0.1, 4: 0.2}  # cap 2 rows: one request per forward
    first = service.iterate({"s": body(num_inference_steps=4, stream=True), "n": body(num_inference_steps=40)})
    assert first["s"].first and not first["s"].final and first["n"].status == 200
    stepped = next(rid for rid in ("s", "n") if service.flights[rid].job.step == 1)
    waiting = "n" if stepped == "s" else "s"
    engine.broken = True
    failed = service.iterate({"s": IncomingRequest(None), "n": IncomingRequest(None)})[stepped]
    assert failed.final and not failed.first and failed.status == 200 and stepped not in service.flights
    payload = json.loads(failed.body.decode().splitlines()[-1])
    assert (
        "boom" in payload["message"]
        and payload["code"] == 500
        and (payload.get("event") == "error") == (stepped == "s")
    )
    engine.broken = False
    parts = run(service, {0: {waiting: IncomingRequest(None)}})[waiting]
    assert parts[-1].final and parts[-1].status == 200 and waiting not in service.flights


def test_a_flagged_image_is_marked_in_json_in_the_header_of_a_one_part_answer_and_in_its_exif():
    service = make_service(SolidColorEngine(flagged_seeds={7}), streaming=False)
    flagged, passed, several = batch(
        service, body(seed=7), body(seed=8), body(seed=6, num_images_per_prompt=2, response_format="json")
    )
    assert flagged.headers[NSFW_HEADER] == "true" and passed.headers[NSFW_HEADER] == "false"
    assert Image.open(io.BytesIO(flagged.body)).getexif()[0x010E] == "nsfw_content_detected=true"
    assert json.loads(several.body)["nsfw_content_detected"] == [False, True] and NSFW_HEADER not in several.headers
    # continuous batching: the headers left with the first (empty) part; the image says it itself
    parts = run(make_service(SolidColorEngine(flagged_seeds={7})), {0: {"c": body(seed=7)}})["c"]
    assert len(parts) > 1 and all(NSFW_HEADER not in part.headers for part in parts)
    assert Image.open(io.BytesIO(parts[-1].body)).getexif()[0x010E] == "nsfw_content_detected=true"


def test_both_loops_record_the_same_metrics():
    traffic = [
        body(seed=1, num_inference_steps=3),
        body(seed=2, num_inference_steps=2, num_images_per_prompt=2),
        body(width=100),
    ]
    dynamic, continuous = RecordingSink(), RecordingSink()
    batch(make_service(sink=dynamic, streaming=False), *traffic)
    run(make_service(sink=continuous), {0: {str(index): item for index, item in enumerate(traffic)}})
    assert (
        dynamic.names()
        == continuous.names()
        == {
            "sd_batch_size",
            "sd_invalid_requests_total",
            "sd_in_flight_requests",
            "sd_in_flight_images",
            "sd_waiting_requests",
            "sd_iteration_batch_size",
            "sd_iteration_cached_images",
            "sd_iteration_lora_adapters",
            "sd_iteration_controlnet_forwards",
            "sd_denoise_step_seconds",
            "sd_pipeline_calls_total",
            "sd_images_total",
            "sd_vae_decode_seconds",
            "sd_request_latency_seconds",
            "sd_request_latency_sla_ratio",
            "sd_encode_seconds",
        }
    )
    for sink in (dynamic, continuous):
        assert sink.values("sd_batch_size") == [3]
        assert sum(sink.values("sd_iteration_batch_size")) == 3 + 2 * 2  # image-steps, however batched
        assert set(sink.values("sd_iteration_lora_adapters")) == {0}  # no LoRA in any forward
        assert set(sink.values("sd_iteration_cached_images")) == {0}  # no step cache
        assert sum(sink.values("sd_images_total")) == 3
        assert len(sink.values("sd_request_latency_seconds")) == 2


def test_deadline_misses_are_counted_from_admission():
    late, in_time = RecordingSink(), RecordingSink()
    batch(make_service(sink=late, streaming=False, sla=1e-6), body(), body(seed=4))
    batch(make_service(sink=in_time, streaming=False, sla=100.0), body(), body(seed=4))
    assert late.values("sd_deadline_misses_total") == [1, 1] and in_time.values("sd_deadline_misses_total") == []


def test_a_lone_request_records_each_value_once_and_the_worker_start_the_constants():
    """Every record is a log line TorchServe's frontend parses: nothing is recorded twice unchanged."""
    sink = RecordingSink()
    service = make_service(sink=sink)
    service.metrics.worker_ready(1.0)
    assert sink.values("sd_latency_sla_seconds") == [2.0] and sink.values("sd_deadline_misses_total") == [0]
    started = len(sink.records)
    run(service, {0: {"a": body(num_inference_steps=4)}})
    lone = sink.records[started:]
    names = [name for name, _, _ in lone]
    assert "sd_latency_sla_seconds" not in names and "sd_deadline_misses_total" not in names
    for gauge in ("sd_in_flight_requests", "sd_in_flight_images", "sd_waiting_requests"):
        values = sink.values(gauge)
        assert all(before != after for before, after in zip(values, values[1:], strict=False)), (gauge, values)
    # per step 5 (forward size, cached images, adapters, ControlNet forwards, time); once 11: its batch, 2
    # gauges up and 2 down, the decode's 3, latency, its SLA ratio and encode
    assert names.count("sd_denoise_step_seconds") == 4 and len(lone) == 4 * 5 + 11, names


def test_a_call_steps_while_the_iteration_budget_lasts_and_returns_when_a_request_finishes():
    service = make_service(iteration_budget_seconds=1.0)  # the clock moves 1 ms a read: the budget lasts
    first = service.iterate({"s": body(num_inference_steps=30, stream=True), "short": body(num_inference_steps=3)})
    assert first["short"].final and first["short"].first and first["short"].status == 200, "one part: its own status"
    assert [json.loads(line)["step"] for line in first["s"].body.decode().splitlines()] == [1, 2, 3]
    assert first["s"].first and not first["s"].final and service.flights["s"].job.step == 3
    second = service.iterate({"s": IncomingRequest(None)})["s"]
    assert second.final and not second.first and len(second.body.decode().splitlines()) == 30 - 3
    one_step = make_service(iteration_budget_seconds=0.0)
    one_step.iterate({"s": body(num_inference_steps=30)})
    assert one_step.flights["s"].job.step == 1


class FailsAfterAdvancingEngine(SolidColorEngine):
    """Runs out of memory once, in the scheduler step of the third job, after advancing the first two."""

    def step(self, jobs: list[DenoiseJob]) -> None:
        if len(jobs) == 3 and not getattr(self, "failed", False):
            self.failed = True
            jobs[0].step += 1
            jobs[1].step += 1
            raise torch.OutOfMemoryError("CUDA out of memory")
        super().step(jobs)


def test_a_retry_after_running_out_of_memory_steps_only_the_jobs_that_did_not_advance():
    service = make_service(FailsAfterAdvancingEngine(), streaming=False)
    responses = batch(service, body(seed=1), body(seed=2), body(seed=3))
    assert [response.status for response in responses] == [200, 200, 200]
    assert [grey(response.body) for response in responses] == [1, 2, 3]
    assert service.engine.steps[0] == ["p"], "the retry stepped only the job that had not advanced"


def test_an_unexpected_error_fails_the_batch_and_the_next_one_starts_clean(monkeypatch):
    sink = RecordingSink()
    service = make_service(sink=sink, streaming=False)
    monkeypatch.setattr(service.finishing, "finish", lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        batch(service, body(seed=1, num_inference_steps=2))
    assert service.flights == {} and sink.values("sd_in_flight_requests")[-1] == 0
    monkeypatch.undo()
    (response,) = batch(service, body(seed=4))
    assert response.status == 200 and grey(response.body) == 4


def test_the_in_flight_gauge_returns_to_zero_when_the_last_request_leaves():
    sink = RecordingSink()
    run(make_service(sink=sink), {0: {"a": body(num_inference_steps=3)}, 1: {"b": body(num_inference_steps=2)}})
    assert max(sink.values("sd_in_flight_requests")) == 2 and sink.values("sd_in_flight_requests")[-1] == 0


# Stopping: the server's drain (handler/control.py tells the service the seconds left).


class Drain:
    """Seconds left in a stop's grace period: None until ``begin``, then falling 0.1 s a read."""

    def __init__(self):
        self.left: float | None = None

    def begin(self, seconds: float) -> None:
        self.left = seconds

    def __call__(self) -> float | None:
        if self.left is None:
            return None
        self.left -= 0.1
        return self.left


@pytest.mark.parametrize("streaming", [False, True])
def test_while_the_server_stops_new_requests_get_503_with_retry_after_in_their_apis_shape(streaming):
    drain = Drain()
    drain.begin(60.0)
    service = make_service(streaming=streaming, drain_left=drain)
    native = IncomingRequest({"prompt": "p"}, "application/json")
    openai = IncomingRequest({"prompt": "p"}, "application/json", path="v1/images/generations")
    models = IncomingRequest(None, path="v1/models")
    requests = {"native": native, "openai": openai, "models": models}
    answers = service.run_batch(requests) if not streaming else service.iterate(requests)
    assert [answers[name].status for name in requests] == [503, 503, 200]
    assert answers["native"].headers == {"Retry-After": "1"} and answers["openai"].headers == {"Retry-After": "1"}
    assert json.loads(answers["native"].body)["type"] == "ShuttingDown"
    assert json.loads(answers["openai"].body)["error"]["type"] == "server_error"
    assert all(answer.final for answer in answers.values()) and service.flights == {}


@pytest.mark.parametrize("streaming", [False, True])
def test_requests_in_flight_finish_during_the_drain_and_what_would_outlast_it_gets_503(streaming):
    """A forward takes 0.1 s by the profile and the drain loses 0.1 s a read: begun with 1 s left
    once both requests are admitted, the short one finishes, the long one is cancelled before
    the step that would end past the grace period."""
    sink = RecordingSink()
    drain = Drain()
    engine = SolidColorEngine()
    step = engine.step

    def step_beginning_the_drain(jobs):  # dynamic batching: the drain begins with the batch's first step
        if drain.left is None and not streaming:
            drain.begin(1.0)
        step(jobs)

    engine.step = step_beginning_the_drain
    service = make_service(engine, sink=sink, streaming=streaming, drain_left=drain)
    traffic = {"long": body(num_inference_steps=100, seed=1), "short": body(num_inference_steps=2, seed=2)}
    if streaming:
        first = service.iterate(traffic)
        assert not any(part.final for part in first.values())
        drain.begin(1.0)
        parts = run(service, {0: {rid: IncomingRequest(None) for rid in traffic}})
        long, short = parts["long"][-1], parts["short"][-1]
        assert long.status == 200 and not long.first  # its 200 left with its first part
    else:
        answers = service.run_batch(traffic)
        long, short = answers["long"], answers["short"]
        assert long.status == 503 and long.headers == {"Retry-After": "1"}
    error = json.loads(long.body)
    assert error["type"] == "ShuttingDown" and "grace period" in error["message"]
    assert short.status == 200 and grey(short.body) == 2
    assert [labels for name, _, labels in sink.records if name == "sd_cancelled_requests_total"] == [("shutdown",)]
    assert service.flights == {}


# Encoding on encoder threads; on a GPU (overlap) collected after the next forward is queued.

STAGGERED = {
    0: {"a": body(seed=1, num_inference_steps=6)},
    1: {"b": body(seed=2, num_inference_steps=2, response_format="json", num_images_per_prompt=2)},
    2: {"c": body(seed=3, num_inference_steps=3, width=128, stream=True)},
}


def finals(parts: dict[str, list]) -> dict[str, tuple[int, bytes]]:
    return {rid: (rid_parts[-1].status, b"".join(part.body for part in rid_parts)) for rid, rid_parts in parts.items()}


def without_timings(data: bytes) -> list:
    """A JSON answer's lines without their times (which differ from run to run)."""
    lines = [json.loads(line) for line in data.decode().splitlines()]
    return [{key: value for key, value in line.items() if key not in ("timings", "elapsed_s")} for line in lines]


def test_encoding_collected_after_the_next_forward_gives_the_same_answers_in_both_loops():
    overlapped = finals(run(make_service(overlap_encoding=True), STAGGERED))
    waited = finals(run(make_service(overlap_encoding=False), STAGGERED))
    assert overlapped.keys() == waited.keys() == {"a", "b", "c"}
    assert overlapped["a"] == waited["a"] and grey(overlapped["a"][1]) == 1
    for rid in "bc":
        assert overlapped[rid][0] == waited[rid][0] == 200
        assert without_timings(overlapped[rid][1]) == without_timings(waited[rid][1])
    requests = (body(seed=4), body(seed=5, num_inference_steps=5), body(seed=6, width=128))
    dynamic = [batch(make_service(streaming=False, overlap_encoding=overlap), *requests) for overlap in (True, False)]
    assert [(r.status, grey(r.body)) for r in dynamic[0]] == [(r.status, grey(r.body)) for r in dynamic[1]]
    assert [grey(r.body) for r in dynamic[0]] == [4, 5, 6]


def test_a_finished_request_is_encoded_while_the_next_forward_steps_the_others(monkeypatch):
    """With overlap, the first forward after a request finished (of a request still denoising)
    runs while that request is encoded, before the service collects the answer: no deadlock, no
    wait."""
    import handler.api.protocol

    engine = SolidColorEngine()
    encoding, stepped = threading.Event(), threading.Event()
    real_step, real_encode = engine.step, handler.api.protocol.encode_images

    def step(jobs):
        if all(job.spec.seeds != (1,) for job in jobs):  # the request with seed 1 has finished
            encoding.wait(timeout=10)
            stepped.set()
        return real_step(jobs)

    def encode_during_a_forward(request, images, metadata):
        if request.seed == 1:  # the request that finishes first
            encoding.set()
            metadata["stepped_meanwhile"] = stepped.wait(timeout=10)
        return real_encode(request, images, metadata)

    monkeypatch.setattr(engine, "step", step)
    monkeypatch.setattr(handler.api.protocol, "encode_images", encode_during_a_forward)
    responses = batch(
        make_service(engine, streaming=False, overlap_encoding=True),
        body(seed=1, num_inference_steps=2, response_format="json"),
        body(seed=2, num_inference_steps=6),
    )
    assert [response.status for response in responses] == [200, 200]
    assert json.loads(responses[0].body)["stepped_meanwhile"] is True
    assert engine.images_made_on and all(thread.startswith("sd-encode") for thread in engine.images_made_on)


@pytest.mark.parametrize("overlap", [True, False])
def test_an_encoding_that_fails_fails_only_its_request(monkeypatch, overlap):
    import handler.api.protocol

    real = handler.api.protocol.encode_image

    def buggy(image, output_format, flag, compression):
        if image.getpixel((0, 0))[0] == 9:
            raise ValueError("encoder broke")
        return real(image, output_format, flag, compression)

    monkeypatch.setattr(handler.api.protocol, "encode_image", buggy)
    responses = batch(
        make_service(streaming=False, overlap_encoding=overlap),
        body(seed=9),
        body(seed=8, num_inference_steps=5),
    )
    assert [response.status for response in responses] == [500, 200]
    assert "encoding failed: ValueError: encoder broke" in json.loads(responses[0].body)["message"]
    assert grey(responses[1].body) == 8


@pytest.mark.parametrize("overlap", [True, False])
def test_a_decode_whose_images_cannot_be_made_fails_only_its_requests_naming_the_postprocess(overlap):
    """The host part of a decode (the safety checker, PIL images) runs on an encoder thread with
    overlap, on the stepping thread without; where it fails, the requests of that decode get a 500
    naming the postprocess, the others their images, and the decode metrics count only the decode
    that made its images."""
    sink, engine = RecordingSink(), SolidColorEngine()
    engine.images_fail_for_seed = 9
    responses = batch(
        make_service(engine, sink, streaming=False, overlap_encoding=overlap),
        body(seed=9),
        body(seed=3),
        body(seed=8, width=128, num_inference_steps=5),
    )
    assert [response.status for response in responses] == [500, 500, 200]
    message = json.loads(responses[0].body)["message"]
    assert message == "postprocess (safety checker or watermark, PIL images) failed: RuntimeError: safety checker broke"
    assert grey(responses[2].body) == 8
    assert len(sink.values("sd_vae_decode_seconds")) == 1
    maker = "sd-encode" if overlap else threading.main_thread().name  # the CPU makes them on the stepping thread
    assert len(engine.images_made_on) == 2 and all(thread.startswith(maker) for thread in engine.images_made_on)


def test_the_profiler_window_opens_at_its_rows_and_summarizes_its_steps(tmp_path, caplog):
    """``handler.profiler``: a lone guided image (2 rows) opens no window of at least 4 rows; two
    together do, and the window closes after 2 forwards with its summary logged and written."""
    profiler = StepsProfiler(torch.device("cpu"), steps=2, min_rows=4, directory=str(tmp_path))
    service = make_service(streaming=False, profiler=profiler)
    assert [response.status for response in batch(service, body(num_inference_steps=3))] == [200]
    assert profiler.summary is None and not any(tmp_path.iterdir())
    caplog.set_level(logging.INFO, logger="handler.engine.profiling")
    assert [response.status for response in batch(service, body(), body(seed=2))] == [200, 200]
    summary = profiler.summary
    assert summary is not None and summary["steps"] == 2 and summary["rows_per_step"] == 4
    assert summary["measure"] == "self CPU time" and summary["wall_s"] > 0 and "device_busy_fraction" not in summary
    (written,) = tmp_path.iterdir()
    assert written.name.startswith("step-profile-") and json.loads(written.read_text()) == summary
    assert "step profile: 2 forwards of 4.0 rows" in caplog.text
    assert [response.status for response in batch(service, body(), body(seed=2))] == [200, 200]
    assert profiler.summary is summary, "one window a worker"


def test_a_profile_that_cannot_be_written_fails_no_request_and_profiles_no_more(tmp_path, caplog):
    taken = tmp_path / "a-file"
    taken.write_text("")
    profiler = StepsProfiler(torch.device("cpu"), steps=1, min_rows=1, directory=str(taken))  # not a directory
    service = make_service(streaming=False, profiler=profiler)
    assert [response.status for response in batch(service, body(), body(seed=2))] == [200, 200]
    assert profiler.summary == {"error": "close"} and "step profile: close failed" in caplog.text
    assert [response.status for response in batch(service, body())] == [200]


def test_each_encoder_thread_takes_the_engines_device_first(monkeypatch):
    """The CUDA runtime's current device is per thread (device 0 until set): each encoder thread
    makes the worker's own its current one before it runs anything (on the CPU, a no-op)."""
    bound: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(loops, "use_device", lambda device: bound.append((threading.current_thread().name, device)))
    service = make_service()
    ran_on = service.finishing.encoder.submit(lambda: threading.current_thread().name).result()
    assert bound and all(device == service.engine.device for _, device in bound)
    assert ran_on in {name for name, _ in bound} and ran_on.startswith("sd-encode")
