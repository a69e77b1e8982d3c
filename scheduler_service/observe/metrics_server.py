"""The metrics' HTTP endpoint: GET /metrics (Prometheus text format, without the `*_created` series,
which would double the series count for a value nobody graphs, and labelled with the served model's
name), GET /health (200 while the service reports SERVING, else 503: for HTTP probes) and 404 for any
other path."""
from __future__ import annotations

import errno
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.registry import Collector

from common.net.ports import METRICS_PORT_IN_USE, PortInUseError, grpc_address, listen_hosts


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


class _IPv6HTTPServer(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def _handler(exposed: Collector, is_serving: Callable[[], bool] | None) -> type[BaseHTTPRequestHandler]:

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(200, generate_latest(exposed), CONTENT_TYPE_PLAIN_0_0_4)  # any Prometheus reads it
            elif path == "/health":
                serving = is_serving is not None and is_serving()
                self._reply(200 if serving else 503, b"SERVING\n" if serving else b"NOT_SERVING\n")
            else:
                self._reply(404, b"not found: /metrics (Prometheus) and /health (200 while SERVING) are served\n")

        def _reply(self, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # every scrape would log a line to stderr
            pass

    return Handler


class MetricsServer:
    """The metrics HTTP endpoint, in daemon threads: /metrics, /health (200 while is_serving() is
    true; None: never) and 404 elsewhere; model_name() labels every sample (see Exposed). A loopback
    host binds 127.0.0.1 and ::1 (listen_hosts). Raises PortInUseError (one line naming host:port)
    when the port is taken."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int,
                 is_serving: Callable[[], bool] | None = None,
                 model_name: Callable[[], str | None] | None = None) -> None:
        handler = _handler(Exposed(registry, model_name), is_serving)
        self._servers: list[ThreadingHTTPServer] = []
        try:
            for address in listen_hosts(host):
                server_type = _IPv6HTTPServer if ":" in address else ThreadingHTTPServer
                try:
                    server = server_type((address.strip("[]"), port if not self._servers else self.port), handler)
                except OSError as error:
                    if error.errno != errno.EADDRINUSE:
                        raise
                    if port == 0 and self._servers:  # the OS's pick for 127.0.0.1 is taken on ::1: IPv4 only
                        continue
                    raise PortInUseError(METRICS_PORT_IN_USE.format(address=grpc_address(host, port))) from None
                server.daemon_threads = True
                self._servers.append(server)
                self.port: int = server.server_port
        except BaseException:
            self.close()
            raise
        self._threads = [threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
                         for server in self._servers]
        for thread in self._threads:
            thread.start()

    def close(self) -> None:
        for server in self._servers:
            if getattr(self, "_threads", None):
                server.shutdown()
            server.server_close()
        for thread in getattr(self, "_threads", []):
            thread.join(timeout=5)
        self._threads = []
