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
    """A sample's value, whatever served model_name labels it (unless asked for); 0 for a labelled
    counter child not created yet."""
    wanted = frozenset(labels.items())
    if (name, wanted) in samples or "model_name" in labels:
        return samples.get((name, wanted), 0.0)
    matches = [number for (sample, sample_labels), number in samples.items()
               if sample == name and frozenset(item for item in sample_labels if item[0] != "model_name") == wanted]
    assert len(matches) <= 1, f"{name}{labels}: {len(matches)} samples"
    return matches[0] if matches else 0.0


def families(samples: Samples) -> set[str]:
    return {name for name, _ in samples}
