"""A real Prometheus server (the `prometheus` binary; .ci/run installs it with apt) scrapes a real
scheduler with the project's prometheus.yml, and every query of the Grafana dashboard evaluates
against what it scraped."""
from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.services_harness import free_port, stop, wait_until
from tests.test_monitoring import FIRST_LOOK, MONITORING, dashboard_expressions
from tests.test_observability_e2e import Services
from tests.test_services_e2e import model_with_tokenizer

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None,
                                reason="no prometheus binary (.ci/run installs Debian's package)")


class Prometheus:
    def __init__(self, folder: Path, target: str) -> None:
        config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
        config["global"]["scrape_interval"] = "1s"  # the project's file, pointed at this scheduler
        config["scrape_configs"][0]["static_configs"] = [{"targets": [target]}]
        (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.address = f"127.0.0.1:{free_port()}"
        self.process = subprocess.Popen(
            ["prometheus", f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'data'}",
             f"--web.listen-address={self.address}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def query(self, expression: str) -> dict:
        url = f"http://{self.address}/api/v1/query?" + urllib.parse.urlencode({"query": expression})
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())

    def value(self, expression: str) -> float | None:
        try:
            result = self.query(expression)["data"]["result"]
        except OSError:  # not listening yet
            return None
        return float(result[0]["value"][1]) if result else None


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Services, Prometheus]]:
    folder = tmp_path_factory.mktemp("prometheus")
    model = model_with_tokenizer(folder, num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64)
    with Services(model, folder / "scheduler.log", 1, "--num-kv-blocks", "64") as services:
        prometheus = Prometheus(folder, f"127.0.0.1:{services.metrics_port}")
        try:
            yield services, prometheus
        finally:
            stop(prometheus.process)


def test_prometheus_scrapes_the_tokens_and_requests_of_real_calls(scraped: tuple[Services, Prometheus]) -> None:
    services, prometheus = scraped
    for index, prompt in enumerate(["hello", "the cat", "on a mat"]):
        services.client.generate(prompt, max_tokens=5 + index, ignore_eos=True, temperature=0)
    wait_until(lambda: prometheus.value("nanovllm_generation_tokens_total") == 5 + 6 + 7, timeout=60,
               what="Prometheus to scrape the generated tokens")
    assert prometheus.value('sum(nanovllm_request_success_total{finish_reason="length"})') == 3
    assert prometheus.value('up{job="nanovllm-scheduler"}') == 1
    assert prometheus.value("nanovllm_workers_ready") == 1


def test_every_dashboard_query_evaluates_on_the_scraped_data(scraped: tuple[Services, Prometheus]) -> None:
    services, prometheus = scraped
    count = "nanovllm_time_to_first_token_seconds_count"
    before = prometheus.value(count) or 0
    services.client.generate("the cat sat", max_tokens=4, ignore_eos=True)
    wait_until(lambda: (prometheus.value(count) or 0) > before, timeout=60, what="the request scraped")
    expressions = dashboard_expressions()
    for expression in expressions:
        reply = prometheus.query(expression)
        assert reply["status"] == "success", (expression, reply)

    def first_look_panels_show_data() -> bool:
        # A rate() needs two scrapes around the request: the panels fill within a few 1 s scrapes.
        return all(any(prometheus.query(e)["data"]["result"] for e in expressions if name in e) for name in FIRST_LOOK)

    wait_until(first_look_panels_show_data, timeout=60, what="data in the panels an operator opens first")
