"""The scheduler's Prometheus metrics (names `nanovllm_*`, base units), one registry per service.

What is recorded, and where (always on the event loop's thread, at the event itself):
- per request, when it ends (scheduler_service.api.request_record): success/failure counters,
  TTFT, e2e, queue time and length histograms, its prompt tokens; per delta: generation tokens
  and the inter-token latency;
- per step (the lanes call observe_step, as a LaneObserver wired where the service is assembled):
  step period, and each lane's own counters (prefix cache, preemptions) carried over as differences;
- at scrape time (a collector): running/waiting requests, KV usage and ready workers, from the load
  report of the lanes' stats snapshots (observe/load_report.py), so nothing is set on the hot path.

Per-delta work is kept to a clock read and a list append: a prometheus_client Histogram.observe
takes a lock and costs 1 to 2 us, and a step brings a delta to each of up to hundreds of requests.
So generated tokens are a plain int, and a request's inter-token gaps are binned with numpy into
a single-writer histogram when the request ends (that histogram lags long requests).

observe/metrics_server.py serves them over HTTP.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from scheduler_service.core.outputs import EngineStats
from scheduler_service.observe.load_report import LoadReport

# Buckets for this engine's range: decode steps of 1 to 50 ms on a GPU (and slower on CPUs),
# inter-token latency from a fraction of a millisecond, requests of up to minutes.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.0002, 0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
               0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 300.0, 600.0,
               1200.0)
QUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                 60.0, 120.0, 300.0)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5,
                1.0, 2.5)
LENGTH_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class LoopHistogram:
    """A histogram written by one thread (the event loop) without a lock; a scrape reads a copy of
    its bucket counts, so it may lag one observation, never a whole one half-counted."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float]) -> None:
        self.name = name
        self.documentation = documentation
        self.upper_bounds = list(buckets)
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.upper_bounds, value)] += 1
        self.sum += value

    def observe_many(self, values: list[float]) -> None:
        """Many observations at once, binned by numpy (a request's inter-token gaps at its end)."""
        if not values:
            return
        array = np.asarray(values)
        binned = np.bincount(np.searchsorted(self.upper_bounds, array, side="left"), minlength=len(self.counts))
        for index in np.flatnonzero(binned).tolist():
            self.counts[index] += int(binned[index])
        self.sum += float(array.sum())

    def family(self) -> HistogramMetricFamily:
        counts = list(self.counts)
        cumulative, total = [], 0
        for bound, count in zip([*map(str, self.upper_bounds), "+Inf"], counts, strict=True):
            total += count
            cumulative.append((bound, total))
        return HistogramMetricFamily(self.name, self.documentation, buckets=cumulative, sum_value=self.sum)


@dataclass
class LoopCounters:
    """Counters incremented on the event loop as plain ints (exposed with `_total`)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    worker_recoveries: int = 0


COUNTER_HELP = {
    "prompt_tokens": "Prompt tokens of requests whose prefill finished",
    "generation_tokens": "Tokens generated and sent to clients",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache at admission",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache at admission (not computed)",
    "num_preemptions": "Sequences preempted for lack of KV blocks (recomputed later)",
    "worker_recoveries": "Times a lost worker answered again and its requests were recomputed",
}


class ServiceMetrics:
    """Every metric of one scheduler service, in its own registry (tests run several in one process).
    With recording off (the service's --metrics-port 0: nobody can read them) nothing is recorded
    per request or per step; the load gauges still read the state when asked."""

    def __init__(self, recording: bool = True) -> None:
        self.recording = recording
        self.registry = CollectorRegistry()
        self.counters = LoopCounters()
        self.request_success = Counter("nanovllm_request_success", "Requests that finished, by finish reason",
                                       ["finish_reason"], registry=self.registry)
        self.request_failure = Counter("nanovllm_request_failure", "Requests that ended with an error status, "
                                       "by gRPC status code (UNAUTHENTICATED: calls of any method refused for "
                                       "want of a valid API key)", ["code"], registry=self.registry)
        self.time_to_first_token = Histogram(
            "nanovllm_time_to_first_token_seconds", "From the request's arrival to its first token",
            buckets=TTFT_BUCKETS, registry=self.registry)
        self.e2e_request_latency = Histogram(
            "nanovllm_e2e_request_latency_seconds", "From the request's arrival to its end",
            buckets=E2E_BUCKETS, registry=self.registry)
        self.request_queue_time = Histogram(
            "nanovllm_request_queue_time_seconds", "From the request's entry in the queue to its first step",
            buckets=QUEUE_BUCKETS, registry=self.registry)
        self.step_duration = Histogram(
            "nanovllm_step_duration_seconds",
            "Time between consecutive step results while the engine is busy (GPU time and unhidden overhead)",
            buckets=STEP_BUCKETS, registry=self.registry)
        self.request_prompt_tokens = Histogram(
            "nanovllm_request_prompt_tokens", "Prompt length of finished requests, in tokens",
            buckets=LENGTH_BUCKETS, registry=self.registry)
        self.request_generation_tokens = Histogram(
            "nanovllm_request_generation_tokens", "Generated length of finished requests, in tokens",
            buckets=LENGTH_BUCKETS, registry=self.registry)
        self.inter_token_latency = LoopHistogram(
            "nanovllm_inter_token_latency_seconds",
            "Time between a request's consecutive outputs, divided by the tokens of the later one",
            ITL_BUCKETS)
        self._load: Callable[[], LoadReport] | None = None
        # Per lane, the cumulative counts of its stats already added.
        self._lane_counts: dict[str, tuple[int, int, int]] = {}
        self.registry.register(_LoopCollector(self))

    def set_load_source(self, load: Callable[[], LoadReport]) -> None:
        """Where the gauges come from at scrape time (a load report of the engine's lanes)."""
        self._load = load

    def load_report(self) -> LoadReport | None:
        return self._load() if self._load is not None else None

    def observe_step(self, lane: str, stats: EngineStats, step_period_s: float | None) -> None:
        """Once per engine step of a lane: the time since its previous step's result (None after an
        idle gap) and its stats, whose counters are added as differences."""
        if not self.recording:
            return
        if step_period_s is not None:
            self.step_duration.observe(step_period_s)
        counts = (stats.num_prefix_query_tokens, stats.num_prefix_hit_tokens, stats.num_preemptions)
        queries, hits, preemptions = self._lane_counts.get(lane, (0, 0, 0))
        if counts != (queries, hits, preemptions):
            self.counters.prefix_cache_queries += counts[0] - queries
            self.counters.prefix_cache_hits += counts[1] - hits
            self.counters.num_preemptions += counts[2] - preemptions
            self._lane_counts[lane] = counts

    def count_recovery(self) -> None:
        self.counters.worker_recoveries += 1


class _LoopCollector(Collector):
    """Exposes the loop's plain counters and histogram, and the gauges read from the load report."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        metrics = self.metrics
        for name, help_text in COUNTER_HELP.items():
            yield CounterMetricFamily(f"nanovllm_{name}", help_text, value=getattr(metrics.counters, name))
        yield metrics.inter_token_latency.family()
        report = metrics.load_report()
        if report is None:
            return
        running = GaugeMetricFamily("nanovllm_num_requests_running", "Requests in the running batch",
                                    labels=["worker"])
        waiting = GaugeMetricFamily("nanovllm_num_requests_waiting", "Requests waiting for admission",
                                    labels=["worker"])
        usage = GaugeMetricFamily("nanovllm_kv_cache_usage_ratio", "KV blocks in use / all KV blocks",
                                  labels=["worker"])
        for address, stats in report.workers:
            running.add_metric([address], stats.num_running)
            waiting.add_metric([address], stats.num_waiting)
            usage.add_metric([address], stats.kv_cache_usage)
        # vLLM's cache_config_info under our prefix, with the labels llm-d's endpoint picker reads (block_size,
        # num_gpu_blocks): its prefix scorer hashes prompts in blocks of the engine's size.
        cache_config = GaugeMetricFamily("nanovllm_cache_config_info", "The KV cache's geometry per worker (value 1)",
                                         labels=["worker", "block_size", "num_gpu_blocks"])
        for address, stats in report.workers:
            if stats.is_attached:
                cache_config.add_metric([address, str(stats.block_size), str(stats.num_kv_blocks)], 1)
        yield from (running, waiting, usage, cache_config)
        yield GaugeMetricFamily("nanovllm_workers_ready", "Workers connected and serving",
                                value=report.num_workers_ready)
