"""An asyncio event loop in a daemon thread, for tests that serve gRPC in-process while the test
calls it synchronously; and the public server and the metrics endpoint served from one."""
from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine, Iterator
from typing import Any

from prometheus_client import CollectorRegistry

from scheduler_service.api.public_server import PublicServer, build_public_server
from scheduler_service.observe.metrics_server import MetricsServer


class LoopThread:
    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name=name)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
        """Runs coro on the loop and waits for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@contextlib.contextmanager
def metrics_served(registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0,
                   loop_thread: LoopThread | None = None, **options: Any) -> Iterator[MetricsServer]:
    """A MetricsServer (options: is_serving, model_name, limits) on loop_thread's loop, as the
    scheduler serves it beside its public server, or on a loop of its own; closed on exit."""
    own = loop_thread is None
    loop = LoopThread("metrics") if loop_thread is None else loop_thread
    try:
        server = loop.run(MetricsServer.start(registry, host, port, **options))
        try:
            yield server
        finally:
            loop.run(server.close())
    finally:
        if own:
            loop.close()


class PublicServerThread:
    """Base of the harnesses that serve build_public_server(engine) on 127.0.0.1 from a LoopThread:
    a subclass's start() sets loop_thread and runs serve(engine) there."""

    run_timeout = 60.0

    def __init__(self) -> None:
        self.loop_thread: LoopThread | None = None
        self.public: PublicServer | None = None

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        assert self.loop_thread is not None
        return self.loop_thread.run(coro, self.run_timeout)

    async def serve(self, engine: Any, **options: Any) -> None:
        """On the loop: builds the public server on a free port and starts it; `options` go to
        build_public_server (config, api_keys); the engine's own metrics, if it has any, record the calls."""
        if hasattr(engine, "metrics"):
            options.setdefault("metrics", engine.metrics)
        self.public = build_public_server(engine, "127.0.0.1", 0, readiness_poll_s=0.02, **options)
        await self.public.start()

    @property
    def target(self) -> str:
        assert self.public is not None
        return f"127.0.0.1:{self.public.port}"
