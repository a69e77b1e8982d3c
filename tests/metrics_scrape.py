"""Reads a Prometheus endpoint over HTTP, as Prometheus does, into {(sample name, labels): value}."""
from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int, host: str = "127.0.0.1") -> Samples:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    """A sample's value; 0 for a labelled counter child not created yet."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def families(samples: Samples) -> set[str]:
    return {name for name, _ in samples}
