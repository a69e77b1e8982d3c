"""The metrics' HTTP endpoint: GET /metrics (Prometheus text format, without the `*_created` series,
which would double the series count for a value nobody graphs, and labelled with the served model's
name), GET /health (200 while the service reports SERVING, else 503: for HTTP probes), 404 for any
other path; HEAD as GET without the body, 405 for other methods. Served by HttpListener in the
scheduler's event loop, with its bounds on connections and timeouts (HttpLimits)."""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.registry import Collector

from common.net.ports import METRICS_PORT_IN_USE
from scheduler_service.observe.http_listener import DEFAULT_LIMITS, HttpLimits, HttpListener, Reply

NOT_FOUND = b"not found: /metrics (Prometheus) and /health (200 while SERVING) are served\n"


class Exposed(Collector):
    """A registry's metrics as served: without their `*_created` samples (prometheus_client adds one per
    counter and histogram; its switch, disable_created_metrics(), is process-wide), and with the served
    model's name as a `model_name` label on every sample once model_name() knows it."""

    def __init__(self, registry: Collector, model_name: Callable[[], str | None] | None = None) -> None:
        self.registry = registry
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        name = self.model_name() if self.model_name is not None else None
        for metric in self.registry.collect():
            created = metric.name + "_created"
            copy = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            copy.samples = [sample._replace(labels={**sample.labels, "model_name": name}) if name else sample
                            for sample in metric.samples if sample.name != created]
            yield copy


class MetricsServer:
    """The metrics HTTP endpoint in the running event loop: /metrics, /health (200 while is_serving()
    is true; None: never) and 404 elsewhere; model_name() labels every sample (see Exposed).

    A scrape runs in the loop, between its other callbacks: the collectors read state the loop owns
    (the lanes' loads, the public server's health), which a scrape from another thread would read
    while the loop changes it; and a scrape takes a few milliseconds, less than a step. Start with
    `await MetricsServer.start(...)`, stop with `await close()`."""

    def __init__(self, listener: HttpListener, port: int) -> None:
        self.listener = listener
        self.port = port

    @classmethod
    async def start(cls, registry: CollectorRegistry, host: str, port: int,
                    is_serving: Callable[[], bool] | None = None,
                    model_name: Callable[[], str | None] | None = None,
                    limits: HttpLimits = DEFAULT_LIMITS) -> MetricsServer:
        """Listens on host:port (port 0 picks a free one; a loopback host binds 127.0.0.1 and ::1:
        listen_hosts). Raises PortInUseError (one line naming host:port) when the port is taken."""
        exposed = Exposed(registry, model_name)

        def answer(path: str) -> Reply:
            if path == "/metrics":
                return Reply(200, generate_latest(exposed), CONTENT_TYPE_PLAIN_0_0_4)  # any Prometheus reads it
            if path == "/health":
                serving = is_serving is not None and is_serving()
                return Reply(200, b"SERVING\n") if serving else Reply(503, b"NOT_SERVING\n")
            return Reply(404, NOT_FOUND)

        listener = HttpListener(answer, limits)
        return cls(listener, await listener.listen(host, port, METRICS_PORT_IN_USE))

    async def close(self) -> None:
        """Stops listening and closes its connections (twice is harmless)."""
        await self.listener.close()
