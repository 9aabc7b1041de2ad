"""Load-test logic without a server: configuration, exact percentiles, SLA verdicts, the sweep report,
retries of requests whose connection ended without an answer (against a stand-in endpoint)."""

import csv
import datetime
import http.server
import json
import re
import socket
import threading
from dataclasses import asdict
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from loadtest.client import post
from loadtest.config import SLA, BenchmarkConfig, MixEntry
from loadtest.report import best_point, write_report
from loadtest.results import PointResult, ServerFigures, server_figures
from loadtest.run import LoadResult, summarize
from loadtest.sweep import warm_up
from server.archive import BATCH_DELAY_MS
from server.paths import BENCHMARK_CONFIG, ROOT

CONFIG = BenchmarkConfig.load(BENCHMARK_CONFIG)


@pytest.mark.parametrize("path", [BENCHMARK_CONFIG, ROOT / "loadtest" / "benchmark_uniform.yaml"])
def test_shipped_configs_are_valid_and_sweep_batching(path):
    config = BenchmarkConfig.load(path)
    assert {1, 4} <= set(config.sweep.batch_size)
    assert config.prompts() and all(entry.width % 8 == 0 for entry in config.request_mix)
    sweep = config.sweep
    assert len(sweep.points()) == (
        len(sweep.continuous_batching)
        * len(sweep.batch_size)
        * len(sweep.max_batch_delay)
        * len(sweep.workers)
        * len(sweep.concurrency)
    )


def test_the_shipped_sweep_measures_both_batching_modes():
    points = CONFIG.sweep.points()
    assert {point.continuous_batching for point in points} == {False, True}
    assert set(BATCH_DELAY_MS.values()) <= set(CONFIG.sweep.max_batch_delay), "the delays packaging ships"
    assert points[0].label.startswith("dynamic, batch") and points[-1].label.startswith("continuous, batch")


def test_the_sweep_leaves_out_continuous_batching_with_more_than_one_worker():
    sweep = CONFIG.sweep.model_copy(
        update={"workers": [1, 2], "batch_size": [8], "max_batch_delay": [50], "concurrency": [8]}
    )
    assert [(point.mode, point.workers) for point in sweep.points()] == [
        ("dynamic", 1),
        ("dynamic", 2),
        ("continuous", 1),
    ]


@pytest.mark.parametrize(
    "change",
    [
        {"sla": {"p95_seconds": 0, "max_error_ratio": 0.01}},
        {"request_mix": []},
        {"request_mix": [{"weight": 1, "width": 100, "height": 64, "num_inference_steps": 4}]},
        {"request_mix": [{"weight": 1, "width": 64, "height": 64, "num_inference_steps": 4, "fields": {"width": 4}}]},
        {"request_mix": [{"weight": 1, "width": 64, "height": 64, "num_inference_steps": 4, "fields": {"seed": 4}}]},
        {"sweep": {"batch_size": []}},
        {"unknown": 1},
    ],
)
def test_bad_configs_are_refused(change):
    data = CONFIG.model_dump(mode="json")
    data.update(change)
    with pytest.raises(ValidationError):
        BenchmarkConfig.model_validate(data)


def test_a_kind_with_request_fields_sends_them_and_is_named_by_them():
    entry = MixEntry(
        weight=1, width=64, height=96, num_inference_steps=4, fields={"scheduler": "euler_a", "clip_skip": 1}
    )
    assert entry.body("a cat", 7) == {
        "scheduler": "euler_a",
        "clip_skip": 1,
        "prompt": "a cat",
        "width": 64,
        "height": 96,
        "num_inference_steps": 4,
        "num_images_per_prompt": 1,
        "response_format": "image",
        "output_format": "png",
        "seed": 7,
    }
    assert "seed" not in entry.body("warm-up")
    assert entry.name == '64x96 4 steps x1 {"clip_skip": 1, "scheduler": "euler_a"}'
    assert MixEntry(weight=1, width=64, height=64, num_inference_steps=4).name == "64x64 4 steps x1"
    with pytest.raises(ValidationError, match=r"response_format, seed: set by the load test"):
        MixEntry(weight=1, width=64, height=64, num_inference_steps=4, fields={"seed": 1, "response_format": "json"})
    with pytest.raises(ValidationError, match=r"fields must be JSON values"):
        MixEntry(
            weight=1, width=64, height=64, num_inference_steps=4, fields={"negative_prompt": datetime.date.today()}
        )
    edit = MixEntry(weight=1, width=64, height=64, num_inference_steps=4, fields={"image": "x" * 1000, "strength": 0.5})
    assert re.fullmatch(r"64x64 4 steps x1 image, strength #[0-9a-f]{8}", edit.name), edit.name


def write_log(path, rows):
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["name", "ok", "latency_s", "images", "end_time"])
        writer.writerows(rows)
    return path


def test_a_warm_up_request_the_server_refuses_stops_the_sweep_naming_its_kind_and_the_answer():
    refusal = b'{"code": 400, "errors": [{"field": "zz", "rule": "extra_forbidden"}]}'

    class Refusing(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(400)
            self.send_header("Content-Length", str(len(refusal)))
            self.end_headers()
            self.wfile.write(refusal)

        def log_message(self, *args) -> None:
            pass

    endpoint = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=endpoint.serve_forever, daemon=True).start()
    server = SimpleNamespace(predictions_url=f"http://127.0.0.1:{endpoint.server_port}/p", auth=dict)
    entry = {"weight": 1, "width": 64, "height": 64, "num_inference_steps": 4, "fields": {"zz": 1}}
    config = CONFIG.model_copy(update={"request_mix": [MixEntry.model_validate(entry)], "warmup_requests": 1})
    try:
        with pytest.raises(RuntimeError, match=r"warm-up request '64x64 4 steps x1 \{\"zz\": 1\}' answered 400: .*zz"):
            warm_up(server, config)
    finally:
        endpoint.shutdown()


def test_summary_has_exact_percentiles_and_throughput(tmp_path):
    rows = [["64x64", 1, (index + 1) / 10, 1, 100 + (index + 1) / 10] for index in range(100)]
    rows[0] = ["128x128", 1, 0.1, 2, 100.1]
    rows[1] = ["64x64", 0, 0.2, 0, 100.2]
    result = summarize(write_log(tmp_path / "log.csv", rows))
    assert (result.requests, result.failures) == (100, 1)
    assert (
        result.p50_s == pytest.approx(5.05)
        and result.p95_s == pytest.approx(9.505)
        and result.p99_s == pytest.approx(9.901)
    )
    assert result.requests_per_s == pytest.approx(99 / 10.0)  # first start 100.0, last end 110.0
    assert result.images_per_s == pytest.approx(100 / 10.0)
    assert result.error_ratio == pytest.approx(0.01)


def result(p95=1.0, failures=0, requests=100, images_per_s=1.0) -> LoadResult:
    return LoadResult(requests, failures, p95 / 2, p95, p95 * 1.2, 1.0, images_per_s, {"95%": p95})


def test_sla_verdicts_name_what_broke():
    sla = SLA(p95_seconds=2.0, max_error_ratio=0.01)
    assert result(p95=2.0).sla_violations(sla) == []
    assert result(p95=2.5).sla_violations(sla) == ["p95 latency 2.500 s exceeds the SLA 2.000 s"]
    assert "error ratio 5.00% (5 of 100)" in result(failures=5).sla_violations(sla)[0]
    assert result(requests=0).sla_violations(sla)[0] == "no request was answered"


def point(batch, images_per_s, p95, meets, tmp_path, continuous=False):
    log = write_log(
        tmp_path / f"b{batch}.csv", [["64x64", 1, 0.5 + index / 100, 1, 100 + index] for index in range(20)]
    )
    sweep_point = CONFIG.sweep.points()[0].model_copy(update={"batch_size": batch, "continuous_batching": continuous})
    return PointResult(
        sweep_point,
        result(p95=p95, images_per_s=images_per_s),
        ServerFigures(0.1, 0.5, float(batch), 2.5, 10, 4.0, 0.5),
        meets,
        [] if meets else ["p95 latency too high"],
        str(log),
    )


def test_the_best_point_is_the_fastest_that_meets_the_sla(tmp_path):
    results = [
        point(1, 2.0, 1.0, True, tmp_path),
        point(4, 3.0, 1.5, True, tmp_path),
        point(8, 5.0, 20.0, False, tmp_path),
    ]
    assert best_point(results).point.batch_size == 4
    assert best_point([results[2]]) is None


def test_report_names_the_best_configuration_with_a_snippet_and_plots(tmp_path):
    results = [point(1, 2.0, 1.0, True, tmp_path), point(4, 3.0, 1.5, True, tmp_path, continuous=True)]
    report = write_report(results, CONFIG, tmp_path).read_text()
    assert "continuous, batch 4, delay" in report.split("## Best configuration")[1]
    snippet = (tmp_path / "model-config-snippet.yaml").read_text()
    assert snippet.startswith("continuousBatching: true\nbatchSize: 4") and "batchSize: 4" in report
    assert "| dynamic | 1 |" in report and "| 2.50 |" in report
    assert (tmp_path / "throughput_vs_p95.png").stat().st_size > 1000
    assert (tmp_path / "best_latency_distribution.png").stat().st_size > 1000
    assert len(json.loads((tmp_path / "points.json").read_text())) == 2
    assert report.count("\n| ") == 4  # header, separator and two points


def test_report_says_when_nothing_meets_the_sla(tmp_path):
    report = write_report([point(8, 5.0, 20.0, False, tmp_path)], CONFIG, tmp_path).read_text()
    assert "No configuration meets the SLA" in report


def test_server_figures_are_deltas_and_queue_time_is_what_the_handler_did_not_see():
    """1.2 s from arrival to answer, 1.0 s of it in the handler: 0.2 s queued."""

    def samples(
        requests, served_us, latency_sum, latency_count, batch_sum, batch_count, step_sum, step_count, images, seconds
    ):
        return {
            ("ts_inference_requests_total", frozenset()): requests,
            ("ts_inference_latency_microseconds_total", frozenset()): served_us,
            ("sd_request_latency_seconds_sum", frozenset()): latency_sum,
            ("sd_request_latency_seconds_count", frozenset()): latency_count,
            ("sd_batch_size_sum", frozenset()): batch_sum,
            ("sd_batch_size_count", frozenset()): batch_count,
            ("sd_iteration_batch_size_sum", frozenset()): step_sum,
            ("sd_iteration_batch_size_count", frozenset()): step_count,
            ("sd_images_total", frozenset()): images,
            ("sd_denoise_step_seconds_sum", frozenset()): seconds,
            ("sd_vae_decode_seconds_sum", frozenset()): seconds / 10,
        }

    figures = server_figures(
        samples(10, 6e6, 5, 10, 10, 5, 40, 20, 10, 3.0), samples(30, 30e6, 25, 30, 30, 10, 100, 40, 34, 19.0)
    )
    expected = ServerFigures(
        mean_queue_s=0.2,
        mean_handler_s=1.0,
        mean_batch_size=4.0,
        mean_step_images=3.0,
        images=24,
        step_seconds=16.0,
        decode_seconds=1.6,
    )
    assert asdict(figures) == pytest.approx(asdict(expected))


def test_the_summary_counts_the_retries(tmp_path):
    path = tmp_path / "log.csv"
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["name", "ok", "latency_s", "images", "end_time", "retries"])
        writer.writerows([["64x64", 1, 0.1, 1, 100.1, 0], ["64x64", 1, 0.2, 1, 100.2, 2]])
    result = summarize(path)
    assert (result.requests, result.failures, result.retries) == (2, 0, 2)


class DropsFirstConnection:
    """A stand-in HTTP endpoint on loopback: the first ``drops`` connections end without an answer,
    later ones get a 200; it records the bodies it read."""

    def __init__(self, drops: int):
        self.drops = drops
        self.bodies: list[bytes] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.predictions_url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/predictions/stable-diffusion"
        threading.Thread(target=self._serve, daemon=True).start()

    def auth(self) -> dict[str, str]:
        return {}

    @staticmethod
    def _read_body(connection: socket.socket) -> bytes:
        data = b""
        while b"\r\n\r\n" not in data:
            data += connection.recv(65536)
        head, body = data.split(b"\r\n\r\n", 1)
        length = int(re.search(rb"content-length: *(\d+)", head, re.IGNORECASE).group(1))
        while len(body) < length:
            body += connection.recv(65536)
        return body

    def _serve(self) -> None:
        while True:
            connection, _ = self.listener.accept()
            with connection:
                self.bodies.append(self._read_body(connection))
                if len(self.bodies) > self.drops:
                    connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")


@pytest.mark.parametrize(("drops", "ok", "retries"), [(0, True, 0), (2, True, 2), (3, False, 2)])
def test_a_request_whose_connection_ended_without_an_answer_is_sent_again_with_the_same_body(drops, ok, retries):
    endpoint = DropsFirstConnection(drops)
    body = {"prompt": "a red circle", "seed": 7}
    _, answered, sent_again = post(endpoint, body, timeout=10)
    assert (answered, sent_again) == (ok, retries)
    assert len(endpoint.bodies) == retries + 1 and all(json.loads(sent) == body for sent in endpoint.bodies)
