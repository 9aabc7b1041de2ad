"""Prometheus and Grafana files, checked without a running stack: promtool and static validation.
(No Grafana server runs here; its files are validated against the structure Grafana provisions.)"""

import json
import re
import subprocess

import pytest
import yaml

from observability import build_metrics_config
from observability.build_dashboard import OUTPUT
from observability.generate import GENERATED, is_current
from observability.prometheus import binary
from server.paths import GRAFANA_DIR, METRICS_CONFIG, PROMETHEUS_DIR, ROOT

DASHBOARD = json.loads(OUTPUT.read_text())


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([binary("promtool"), *args], cwd=PROMETHEUS_DIR, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "args",
    [
        ("check", "config", "prometheus.yml"),
        ("check", "rules", "rules/recording.yml", "rules/alerts.yml"),
        ("test", "rules", "tests/alerts_test.yml"),
    ],
)
def test_promtool_accepts_config_rules_and_rule_tests(args):
    result = promtool(*args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_every_alert_has_a_unit_test_and_a_runbook_entry():
    alerts = [
        rule["alert"]
        for group in yaml.safe_load((PROMETHEUS_DIR / "rules" / "alerts.yml").read_text())["groups"]
        for rule in group["rules"]
    ]
    tested = {
        item["alertname"]
        for test in yaml.safe_load((PROMETHEUS_DIR / "tests" / "alerts_test.yml").read_text())["tests"]
        for item in test.get("alert_rule_test", [])
    }
    runbook = (ROOT / "docs" / "observability.md").read_text()
    assert set(alerts) == tested
    for alert in alerts:
        assert f"`{alert}`" in runbook, f"{alert} has no entry in docs/observability.md"


@pytest.mark.parametrize("name", GENERATED)
def test_committed_generated_files_are_what_their_builders_make(name):
    assert is_current(name), f"{GENERATED[name][0]} is stale: run `make {name}` and commit the result"


def test_the_generator_check_fails_on_a_stale_file(tmp_path, monkeypatch):
    stale = tmp_path / "metrics.yaml"
    stale.write_text("# edited by hand\n")
    monkeypatch.setitem(GENERATED, "metrics-config", (stale, build_metrics_config.render))
    assert not is_current("metrics-config")


def panels(kind: str | None = None) -> list[dict]:
    return [panel for panel in DASHBOARD["panels"] if kind is None or panel["type"] == kind]


def test_dashboard_has_the_panels_operators_need():
    titles = " | ".join(panel["title"] for panel in panels()).lower()
    for needed in (
        "request rate",
        "latency",
        "sla",
        "queue wait",
        "in flight per worker",
        "batch size",
        "denoising step",
        "images per second",
        "errors by status code",
        "workers",
        "cpu and memory",
        "gpu",
    ):
        assert needed in titles, needed
    for panel in panels("timeseries"):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"] and all(target["expr"] for target in panel["targets"])


def test_dashboard_panels_do_not_overlap():
    occupied = set()
    for panel in panels():
        grid = panel["gridPos"]
        cells = {
            (x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & occupied, panel["title"]
        assert grid["x"] + grid["w"] <= 24
        occupied |= cells


def metric_names(expr: str) -> set[str]:
    """Series names a PromQL expression selects (label matchers, groupings and functions left out)."""
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\b(by|on|ignoring|without)\s*\([^)]*\)", " ", expr)
    names = set(re.findall(r"\b[A-Za-z_:][A-Za-z0-9_:]*\b(?!\s*\()", expr))
    return {name for name in names if name not in {"and", "or", "unless", "group_left", "group_right"}}


def test_dashboard_queries_use_only_known_metrics_and_variables():
    recorded = yaml.safe_load((PROMETHEUS_DIR / "rules" / "recording.yml").read_text())["groups"]
    known = {rule["record"] for group in recorded for rule in group["rules"]}
    known |= {line.split("name: ")[1] for line in METRICS_CONFIG.read_text().splitlines() if "- name: " in line}
    variables = {variable["name"] for variable in DASHBOARD["templating"]["list"]}
    for panel in panels("timeseries"):
        for target in panel["targets"]:
            names = {re.sub(r"_(bucket|sum|count)$", "", name) for name in metric_names(target["expr"])}
            assert names and names <= known, (panel["title"], names - known)
            assert set(re.findall(r"\$(\w+)", target["expr"])) <= variables


def test_grafana_provisioning_points_at_the_dashboard_and_datasource():
    datasources = yaml.safe_load((GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert datasources["apiVersion"] == 1
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["url"].startswith("http") and source["isDefault"]
    providers = yaml.safe_load((GRAFANA_DIR / "provisioning" / "dashboards" / "stable-diffusion.yml").read_text())
    (provider,) = providers["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]
    assert DASHBOARD["uid"] == "stable-diffusion" and DASHBOARD["title"]
