"""Calls the public port refuses for want of a valid API key, through the real server: each counts
in nanovllm_request_failure_total{code="UNAUTHENTICATED"}, whatever its method, and at most one INFO
line per interval says how many there were, without the key."""
from __future__ import annotations

import logging
import re

import grpc
import pytest

from common.client import GenerationClient
from common.security.api_keys import ApiKeys
from tests import raw_http2
from tests.scheduler_service.public_server_harness import FakeEngine, ServerThread
from tests.services_harness import wait_until

KEY = "refused-calls-key-0123456789"
INTERVAL_S = 0.5
SUMMARY = re.compile(r"refused (\d+) calls? without a valid API key in the last ([0-9.]+) s")


def refused(engine: FakeEngine) -> float:
    return engine.metrics.registry.get_sample_value("nanovllm_request_failure_total",
                                                    {"code": "UNAUTHENTICATED"}) or 0.0


def summaries(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "scheduler_service.api.refused_calls"]


def test_refused_calls_are_counted_and_summarised_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    engine = FakeEngine(None)
    server = ServerThread(engine, api_keys=ApiKeys(None, KEY), refused_log_interval_s=INTERVAL_S).start()
    try:
        host, port = server.target.split(":")
        with GenerationClient(server.target, api_key="wrong-key", timeout=10) as wrong, \
                GenerationClient(server.target, timeout=10) as keyless, \
                GenerationClient(server.target, api_key=KEY, timeout=10) as good:
            for call in [lambda: wrong.generate("hello"), lambda: wrong.tokenize("hello"),
                         lambda: wrong.model_info(), lambda: keyless.generate("hello")]:
                with pytest.raises(grpc.RpcError) as error:
                    call()
                assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # The key itself with a byte gRPC does not allow: refused all the same, and counted.
            response = raw_http2.call(host, int(port), "/nanovllm.generate.v1.TextGeneration/GetModelInfo",
                                      [(b"authorization", f"Bearer {KEY}".encode() + b"\xff")])
            assert response.grpc_status == grpc.StatusCode.UNAUTHENTICATED.value[0]
            assert good.model_info().max_model_len == 32  # a valid key is neither refused nor counted
            assert good.health_status() == "SERVING"
        assert refused(engine) == 5
        wait_until(lambda: sum(int(SUMMARY.fullmatch(r.getMessage())[1]) for r in summaries(caplog)) == 5,
                   timeout=10, what="summaries of all 5 refused calls")
    finally:
        server.stop()
    lines = summaries(caplog)
    assert all(r.levelno == logging.INFO and SUMMARY.fullmatch(r.getMessage()) for r in lines)
    for earlier, later in zip(lines, lines[1:], strict=False):  # a slow machine may split them in windows
        assert later.created - earlier.created >= INTERVAL_S - 0.05
    assert not [r for r in caplog.records if KEY in r.getMessage() or "wrong-key" in r.getMessage()]


def test_a_summary_still_open_when_the_server_stops_is_written(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="scheduler_service.api.refused_calls")
    engine = FakeEngine(None)
    server = ServerThread(engine, api_keys=ApiKeys(None, KEY), refused_log_interval_s=3600).start()
    try:
        with GenerationClient(server.target, timeout=10) as keyless, pytest.raises(grpc.RpcError):
            keyless.tokenize("hello")
        assert summaries(caplog) == []  # its window is open for an hour
    finally:
        server.stop()
    assert [SUMMARY.fullmatch(r.getMessage())[1] for r in summaries(caplog)] == ["1"]
