"""A real Prometheus scraping the test TorchServe: after real traffic, every recording rule, every
alert's inputs and every dashboard query returns data."""

from __future__ import annotations

import itertools
import json
import re
import shutil
import socket
import time

import pytest
import yaml

from observability import prometheus as prometheus_module
from observability.build_dashboard import GPU_ONLY, OUTPUT
from observability.prometheus import RULE_FILES, Prometheus
from server import free_port
from server.paths import K8S_DIR
from tests.harness.serving import run_behind_blocker

MODEL = "stable-diffusion"
SPLIT_OPERATORS = re.compile(r"\s(?:>=|<=|==|!=|>|<|and|or|unless)\s")
MODIFIER = re.compile(r"^\s*(?:on|ignoring)\s*\([^)]*\)\s*(?:group_left|group_right)?\s*(?:\([^)]*\))?")


@pytest.fixture(scope="module")
def prometheus(server, client, tmp_path_factory) -> Prometheus:
    """Prometheus scraping the test server every second, after a mix of traffic it has seen."""
    with Prometheus(server.addresses.metrics, tmp_path_factory.mktemp("prometheus")) as instance:
        instance.wait_for('up{job="torchserve"} == 1')
        # The handler's series appear with their first observation; one scrape of them before the
        # traffic lets rates see them grow (a series born with its count has a rate of 0).
        assert client.predict({"prompt": "warm", "num_inference_steps": 2}).status_code == 200
        instance.wait_for(f'sd_request_latency_sla_ratio_count{{model_name="{MODEL}"}}')
        time.sleep(2)
        assert client.predict({"prompt": "x", "width": 100}).status_code == 400
        responses = run_behind_blocker(
            client, [{"prompt": f"p{index}", "num_inference_steps": 3, "seed": index} for index in range(3)]
        )
        assert all(response.status_code == 200 for response in responses)
        for quantile in ("p50", "p95", "p99"):  # NaN until the rate windows hold the traffic; wait for numbers
            instance.wait_for(
                f'model_name:sd_request_latency_seconds:{quantile}_5m{{model_name="{MODEL}"}} > 0', timeout=60
            )
        time.sleep(3)  # a few evaluation rounds for rules built on rules
        yield instance


def top_level_operands(expr: str) -> list[str]:
    """Split an alert expression at comparison and set operators outside brackets: its inputs."""
    depth, cuts = 0, [0]
    for index, char in enumerate(expr):
        depth += char in "([{"
        depth -= char in ")]}"
        if depth == 0:
            match = SPLIT_OPERATORS.match(expr, index)
            if match:
                cuts += [match.start(), match.end()]
    pieces = [expr[start:end] for start, end in zip(cuts[::2], cuts[1::2] + [len(expr)], strict=False)]
    operands = [MODIFIER.sub("", piece).strip() for piece in pieces]
    return [operand for operand in operands if operand and not re.fullmatch(r"[\d.]+", operand)]


def test_operand_splitting():
    assert top_level_operands("a > 1") == ["a"]
    assert top_level_operands("a > 0\nunless on (m) sum by (m) (rate(b[5m])) > 0") == ["a", "sum by (m) (rate(b[5m]))"]
    assert top_level_operands("a > on (m) 0.5 * c\nand on (m) deriv(a[10m]) > 0") == ["a", "0.5 * c", "deriv(a[10m])"]


def test_every_rule_is_loaded_and_healthy(prometheus):
    rules = prometheus.rules()
    expected = sum(len(group["rules"]) for path in RULE_FILES for group in yaml.safe_load(path.read_text())["groups"])
    assert len(rules) == expected
    assert [rule["name"] for rule in rules if rule["health"] != "ok"] == []


def test_every_recording_rule_returns_data(prometheus):
    empty = [
        rule["name"]
        for rule in prometheus.rules()
        if rule["type"] == "recording" and not prometheus.query(rule["name"])
    ]
    assert empty == []


def test_every_alert_input_returns_data_and_nothing_fires(prometheus):
    for rule in prometheus.rules():
        if rule["type"] != "alerting":
            continue
        prometheus.query(rule["query"])  # valid PromQL
        for operand in top_level_operands(rule["query"]):
            assert prometheus.query(operand), f"{rule['name']}: {operand!r} returns no data"
        assert rule["state"] == "inactive", f"{rule['name']} is {rule['state']} on a healthy server"


def test_every_dashboard_query_returns_data(prometheus):
    dashboard = json.loads(OUTPUT.read_text())
    has_gpu = shutil.which("nvidia-smi") is not None
    checked = 0
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$model", MODEL)
            result = prometheus.query(expr)
            if panel.get("description") == GPU_ONLY and not has_gpu:
                assert result == [], "GPU metrics on a host without a GPU"
                continue
            assert result, f"{panel['title']}: {expr!r} returns no data"
            checked += 1
    assert checked >= 15


def test_latency_quantiles_are_consistent(prometheus):
    def scalar(expr: str) -> float:
        return float(prometheus.query(expr)[0]["value"][1])

    selector = f'{{model_name="{MODEL}"}}'
    p50, p95, p99 = (scalar(f"model_name:sd_request_latency_seconds:{q}_5m{selector}") for q in ("p50", "p95", "p99"))
    assert 0 < p50 <= p95 <= p99
    assert scalar(f"model_name:sd_latency_sla_seconds:max{selector}") == 10
    assert scalar(f"model_name:sd_batch_size:mean5m{selector}") >= 1


def test_autoscaler_metric_queries_read_each_instance(prometheus):
    """The prometheus-adapter rules behind the HPA (deploy/k8s/prometheus-adapter/values.yaml), their
    templates filled in as the adapter does (here the per-instance label is instance, in a cluster
    it is pod): one series per instance each; requests queued behind the busy worker read above zero."""
    values = yaml.safe_load((K8S_DIR / "prometheus-adapter" / "values.yaml").read_text())
    read = {}
    for rule in values["rules"]["custom"]:
        query = (
            rule["metricsQuery"]
            .replace("<<.Series>>", rule["seriesQuery"].split("{")[0])
            .replace("<<.LabelMatchers>>", f'model_name="{MODEL}"')
            .replace("<<.GroupBy>>", "instance")
        )
        [result] = prometheus.query(query)
        assert set(result["metric"]) == {"instance"}, query
        read[rule["name"]["as"]] = float(result["value"][1])
    assert set(read) == {"sd_queued_requests", "sd_in_flight_images"}
    assert read["sd_queued_requests"] > 0, "no queueing read"
    assert read["sd_in_flight_images"] == 0, "the traffic is over: nothing is in flight"


def test_a_prometheus_whose_port_was_taken_before_it_bound_starts_again_on_another(monkeypatch, tmp_path):
    """The free port picked for it is taken by another listener before it binds: it exits, and is
    started again on a fresh free port."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        picks = itertools.chain([taken], iter(free_port, None))
        monkeypatch.setattr(prometheus_module, "free_port", lambda: next(picks))
        with Prometheus("http://127.0.0.1:9", tmp_path) as instance:
            assert instance.port != taken and instance.rules()
    assert prometheus_module.PORT_IN_USE in (tmp_path / "prometheus.log").read_text()
