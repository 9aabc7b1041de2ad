"""The handler's own metrics on TorchServe's Prometheus endpoint, in both batching modes, checked
against the traffic sent."""

from __future__ import annotations

import pytest
from PIL import Image

from handler.metrics import METRICS
from tests.harness.images import png_base64
from tests.harness.serving import (
    SHIPPED_CONFIG,
    Client,
    eventually,
    run_behind_blocker,
    server_log,
    settled_samples,
    value,
)

# What TorchServe's default logging writes per request and server/log4j2.xml leaves out.
PER_REQUEST_NOISE = ("result=[METRICS]", "Flushing req.cmd", "Waiting time ns")


@pytest.mark.parametrize("mode", ["dynamic_server", "continuous_server"])
def test_every_declared_metric_is_exported_after_traffic_in_both_modes(request, mode):
    server = request.getfixturevalue(mode)
    client = Client(server)
    assert client.predict({"prompt": "x", "width": 100}).status_code == 400
    assert client.predict({"prompt": "x", "num_inference_steps": 2}).status_code == 200
    assert client.predict({"prompt": "x", "num_inference_steps": 2, "loras": [{"name": "outline"}]}).status_code == 200
    control = {"name": "shapes-mask", "image": png_base64(Image.new("RGB", (64, 64)))}  # no shape
    assert client.predict({"prompt": "x", "num_inference_steps": 2, "controlnets": [control]}).status_code == 200
    names = {name for name, _ in settled_samples(client)}
    for spec in METRICS:
        exported = f"{spec.name}_count" if spec.type == "histogram" else spec.name
        assert exported in names, f"{spec.name} is not exported ({mode})"
    # server/log4j2.xml: metric lines parsed, not echoed into the log; no per-request DEBUG lines; each
    # line written once (to the console, then to ts_log.log: compared once both have it)
    log = server_log(server, "ts_log")
    assert not [line for line in PER_REQUEST_NOISE if line in log]
    assert log.count("Backend response time") >= 3

    def written_once() -> bool:
        once = server.console_log.read_text(errors="replace").count("Backend response time")
        return server_log(server, "ts_log").count("Backend response time") == once

    eventually(written_once, "each frontend line written once to ts_log.log", timeout=10)


def test_metric_values_match_the_traffic_of_a_dynamic_batch(dynamic_client, dynamic_server):
    before = settled_samples(dynamic_client)
    bodies = [
        {"prompt": "a", "num_inference_steps": 3, "seed": 1},
        {"prompt": "b", "num_inference_steps": 3, "seed": 2, "num_images_per_prompt": 2},
        {"prompt": "c", "num_inference_steps": 3, "width": 100},
    ]
    responses = run_behind_blocker(dynamic_client, bodies)
    assert [response.status_code for response in responses] == [200, 200, 400]
    after: dict = {}

    def delta(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    def answered() -> bool:
        """The frontend parses the worker's metric lines apart from its answers."""
        after.update(dynamic_server.metric_samples())
        return delta("sd_request_latency_seconds_count") == delta("sd_encode_seconds_count") == 3

    eventually(answered, "the latencies and encodings of the requests sent", timeout=30)

    blocker_steps = 100
    assert delta("sd_batch_size_count") == 2  # the blocker's batch, then the three followers together
    assert delta("sd_batch_size_sum") == 4
    assert delta("sd_iteration_batch_size_sum") == blocker_steps + 3 * (1 + 2)  # image-steps
    assert delta("sd_iteration_batch_size_count") == delta("sd_denoise_step_seconds_count")
    assert blocker_steps + 3 <= delta("sd_denoise_step_seconds_count") <= blocker_steps + 6
    assert (
        delta("sd_pipeline_calls_total") == delta("sd_vae_decode_seconds_count") == 2
    )  # the followers finish together
    assert delta("sd_images_total") == 1 + 3
    assert delta("sd_request_latency_seconds_count") == delta("sd_request_latency_sla_ratio_count") == 3
    assert delta("sd_encode_seconds_count") == 3 and delta("sd_deadline_misses_total") == 0
    assert delta("sd_invalid_requests_total", field="width") == 1
    step_mean = delta("sd_denoise_step_seconds_sum") / delta("sd_denoise_step_seconds_count")
    assert 0 < step_mean < 10
    sla = value(after, "sd_latency_sla_seconds")
    assert sla == SHIPPED_CONFIG["handler"]["metrics"]["latency_sla_seconds"]
    assert delta("sd_request_latency_sla_ratio_sum") == pytest.approx(delta("sd_request_latency_seconds_sum") / sla)
    assert value(after, "sd_worker_warmup_seconds") > 0
    assert delta("ts_inference_requests_total", model_version="default") == 4
