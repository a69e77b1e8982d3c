"""The monitoring files (scheduler_service/observe/monitoring/) against what the scheduler really exports:
the Grafana dashboard queries only metrics a live /metrics endpoint serves, Prometheus scrapes every
scheduler at the port compose.yaml gives it, and the README lists every metric."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest
import yaml

from scheduler_service.core.outputs import EngineStats
from scheduler_service.observe.load_report import LoadReport
from scheduler_service.observe.metrics import ServiceMetrics
from tests.loop_thread import metrics_served
from tests.metrics_scrape import scrape
from tests.services_harness import REPO_ROOT

MONITORING = REPO_ROOT / "scheduler_service" / "observe" / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "nanovllm.json"
METRIC_NAME = re.compile(r"\bnanovllm_[a-z_]+\b")
# The panels an operator opens first must be there.
FIRST_LOOK = ["nanovllm_num_requests_running", "nanovllm_num_requests_waiting", "nanovllm_kv_cache_usage_ratio",
              "nanovllm_time_to_first_token_seconds_bucket", "nanovllm_inter_token_latency_seconds_bucket",
              "nanovllm_generation_tokens_total"]


@pytest.fixture(scope="module")
def exported() -> Iterator[dict]:
    """Samples of a metrics endpoint over HTTP, with every labelled child in use."""
    metrics = ServiceMetrics()
    metrics.set_load_source(lambda: LoadReport.of([("w0", EngineStats(True, 1, 0, 8, 4))]))
    metrics.request_success.labels("length").inc()
    metrics.request_failure.labels("CANCELLED").inc()
    with metrics_served(metrics.registry) as server:
        yield scrape(server.port)


def dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def test_dashboard_queries_only_exported_metrics(exported: dict) -> None:
    sample_names = {name for name, _ in exported}
    queried = {name for expr in dashboard_expressions() for name in METRIC_NAME.findall(expr)}
    assert queried - sample_names == set()
    assert set(FIRST_LOOK) <= queried


def test_dashboard_panels_use_the_provisioned_datasource() -> None:
    datasource = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = datasource["datasources"][0]["uid"]
    dashboard = json.loads(DASHBOARD.read_text())
    assert {panel["datasource"]["uid"] for panel in dashboard["panels"]} == {uid}
    provider = yaml.safe_load((MONITORING / "grafana/provisioning/dashboards/nanovllm.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"


def test_prometheus_scrapes_every_scheduler_at_the_port_compose_gives_it() -> None:
    compose = yaml.safe_load((REPO_ROOT / "compose.yaml").read_text())
    expected = set()
    for name, service in compose["services"].items():
        command = service.get("command") or []
        if command[:1] == ["scheduler"]:
            expected.add(f"{name}:{command[command.index('--metrics-port') + 1]}")
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    assert len(config["scrape_configs"]) == 1  # tests/test_prometheus_server.py points this job at its scheduler
    targets = [t for job in config["scrape_configs"] for static in job["static_configs"] for t in static["targets"]]
    assert sorted(targets) == sorted(expected) and len(expected) == 3


def test_readme_lists_every_metric(exported: dict) -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    suffixes = re.compile(r"_(bucket|count|sum|created)$")
    families = {suffixes.sub("", name) for name, _ in exported if not name.endswith("_created")}
    assert sorted(name for name in families if f"`{name}" not in readme) == []
