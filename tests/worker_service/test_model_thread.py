"""The worker loads its model on the thread that runs it (worker_service.api.server.model_thread): on a
CPU a second thread that ran torch's parallel ops would keep a second OpenMP team, and with more
team threads than cores libgomp stops spinning between ops (single-stream decode of the default
model at less than half speed on 2 cores)."""
from __future__ import annotations

import asyncio
import threading

import pytest

from common.contract.config import WorkerConfig, WorkerLinkConfig
from launch import worker as main
from worker_service.runtime import tp_group


class _Loaded(Exception):
    """Stops the worker right after its model would have loaded."""


def test_the_model_loads_on_the_model_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    loaded_on: list[str] = []

    def create_worker_core(config: WorkerConfig) -> None:
        loaded_on.append(threading.current_thread().name)
        raise _Loaded

    monkeypatch.setattr(tp_group, "create_worker_core", create_worker_core)
    with pytest.raises(_Loaded):
        asyncio.run(main._serve_worker(WorkerConfig(model="unused"), WorkerLinkConfig(secret="s"), "127.0.0.1", 0))
    assert len(loaded_on) == 1 and loaded_on[0].startswith("model")
