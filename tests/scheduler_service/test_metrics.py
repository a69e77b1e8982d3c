"""ServiceMetrics' own recording, read back over HTTP: the lock-free inter-token histogram's
buckets, each lane's counters added as differences, and the served model's label on every sample."""
from __future__ import annotations

from scheduler_service.core.outputs import EngineStats
from scheduler_service.observe.metrics import ITL_BUCKETS, ServiceMetrics
from tests.loop_thread import metrics_served
from tests.metrics_scrape import scrape, value


def scraped(metrics: ServiceMetrics) -> dict:
    with metrics_served(metrics.registry) as server:
        return scrape(server.port)


def test_inter_token_buckets_count_a_value_on_a_bound_in_that_bucket() -> None:
    metrics = ServiceMetrics()
    metrics.inter_token_latency.observe_many([0.001, 0.0011, 0.00005])
    metrics.inter_token_latency.observe(100.0)
    samples = scraped(metrics)
    name = "nanovllm_inter_token_latency_seconds"
    assert value(samples, f"{name}_bucket", le="0.0002") == 1
    assert value(samples, f"{name}_bucket", le="0.001") == 2  # 0.001 itself is <= 0.001
    assert value(samples, f"{name}_bucket", le="0.0015") == 3
    assert value(samples, f"{name}_bucket", le=str(ITL_BUCKETS[-1])) == 3
    assert value(samples, f"{name}_bucket", le="+Inf") == value(samples, f"{name}_count") == 4
    assert abs(value(samples, f"{name}_sum") - 100.00215) < 1e-9


def test_lane_counters_are_added_as_differences_per_lane() -> None:
    metrics = ServiceMetrics()
    metrics.observe_step("a", EngineStats(True, 0, 0, 8, 8, 40, 16, 1), None)
    metrics.observe_step("a", EngineStats(True, 0, 0, 8, 8, 100, 16, 3), 0.004)
    metrics.observe_step("b", EngineStats(True, 0, 0, 8, 8, 10, 0, 0), 0.002)  # another lane counts apart
    metrics.count_recovery()
    samples = scraped(metrics)
    assert (value(samples, "nanovllm_prefix_cache_queries_total"), value(samples, "nanovllm_prefix_cache_hits_total"),
            value(samples, "nanovllm_num_preemptions_total")) == (110, 16, 3)
    assert value(samples, "nanovllm_worker_recoveries_total") == 1
    assert value(samples, "nanovllm_step_duration_seconds_count") == 2


def test_every_sample_is_labelled_with_the_served_model_once_known() -> None:
    metrics = ServiceMetrics()
    metrics.request_success.labels("length").inc()
    name: list[str | None] = [None]
    with metrics_served(metrics.registry, model_name=lambda: name[0]) as server:
        before = scrape(server.port)
        name[0] = "qwen3-0.6b"
        after = scrape(server.port)
    assert all("model_name" not in dict(labels) for _, labels in before)
    assert all(dict(labels).get("model_name") == "qwen3-0.6b" for _, labels in after)
    assert value(after, "nanovllm_request_success_total", finish_reason="length", model_name="qwen3-0.6b") == 1
