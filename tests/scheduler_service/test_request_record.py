"""Request metrics, request log lines and GetLoad through the real public server (a FakeEngine
behind it), scraped over real HTTP from the metrics server."""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator

import grpc
import pytest

from common.client import build_request
from common.generated.nanovllm.generate.v1 import generate_pb2, generate_pb2_grpc
from launch.log_format import JsonFormatter, TextFormatter
from scheduler_service.api.request_record import valid_traceparent
from scheduler_service.api.tokenizer import load_tokenizer
from scheduler_service.observe.metrics import ServiceMetrics
from tests import raw_http2
from tests.loop_thread import metrics_served
from tests.metrics_scrape import scrape, value
from tests.scheduler_service.public_server_harness import FakeEngine, ServerThread, save_tiny_tokenizer
from tests.services_harness import wait_until

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    tokenizer = load_tokenizer(str(save_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))))
    thread = ServerThread(FakeEngine(tokenizer)).start()
    yield thread
    thread.stop()


@pytest.fixture(scope="module")
def metrics_port(server: ServerThread) -> Iterator[int]:
    with metrics_served(server.engine.metrics.registry, loop_thread=server.loop_thread) as metrics_server:
        yield metrics_server.port


@pytest.fixture
def engine(server: ServerThread) -> Iterator[FakeEngine]:
    yield server.engine
    server.engine.queue_full = server.engine.hang_after_first_output = False


@pytest.fixture
def stub(server: ServerThread) -> Iterator[generate_pb2_grpc.TextGenerationStub]:
    with grpc.insecure_channel(server.target) as channel:
        yield generate_pb2_grpc.TextGenerationStub(channel)


@pytest.fixture
def request_lines(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="nanovllm.requests")
    return caplog


def line_of(caplog: pytest.LogCaptureFixture, request_id: str) -> dict:
    """The fields of the one request line of request_id (waits for it: a stream's line is written
    when the server's generator ends, which may be after the client saw the last message)."""
    def matching() -> list[logging.LogRecord]:
        return [r for r in list(caplog.records)
                if r.name == "nanovllm.requests" and r.fields["request_id"] == request_id]

    wait_until(lambda: len(matching()) >= 1, timeout=10, what=f"the log line of {request_id}")
    assert len(matching()) == 1
    return matching()[0].fields


def test_finished_request_is_counted_and_logged_once(stub, metrics_port: int, request_lines) -> None:
    before = scrape(metrics_port)
    stub.Generate(build_request("hello world", request_id="ok-1"), metadata=[("traceparent", TRACEPARENT)])
    fields = line_of(request_lines, "ok-1")
    assert fields == {"request_id": "ok-1", "model": "fake-model", "method": "Generate", "status": "OK",
                      "finish_reason": "stop", "prompt_tokens": 2, "completion_tokens": 3, "cached_tokens": 2,
                      "ttft_s": fields["ttft_s"],
                      "e2e_s": fields["e2e_s"], "queue_time_s": None, "traceparent": TRACEPARENT}
    assert 0 <= fields["ttft_s"] <= fields["e2e_s"]
    after = scrape(metrics_port)
    for name, labels, delta in [("nanovllm_request_success_total", {"finish_reason": "stop"}, 1),
                                ("nanovllm_prompt_tokens_total", {}, 2),
                                ("nanovllm_generation_tokens_total", {}, 3),
                                ("nanovllm_time_to_first_token_seconds_count", {}, 1),
                                ("nanovllm_inter_token_latency_seconds_count", {}, 2),
                                ("nanovllm_e2e_request_latency_seconds_count", {}, 1),
                                ("nanovllm_request_generation_tokens_sum", {}, 3)]:
        assert value(after, name, **labels) - value(before, name, **labels) == delta, name


def test_stream_line_names_its_method_and_a_garbage_traceparent_is_left_out(stub, request_lines) -> None:
    garbage = "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01 status=OK"
    list(stub.GenerateStream(build_request("hello", request_id="stream-1"), metadata=[("traceparent", garbage)]))
    fields = line_of(request_lines, "stream-1")
    assert (fields["method"], fields["status"], fields["completion_tokens"]) == ("GenerateStream", "OK", 3)
    assert "traceparent" not in fields


def test_with_recording_off_requests_are_logged_and_nothing_is_counted(stub, server: ServerThread,
                                                                     request_lines) -> None:
    """--metrics-port 0: the request line stays, the metrics record nothing (not even the first token)."""
    servicer = server.public.servicer
    recording = servicer.metrics
    servicer.metrics = ServiceMetrics(recording=False)
    try:
        stub.Generate(build_request("hello world", request_id="off-1"))
        list(stub.GenerateStream(build_request("hello", request_id="off-2")))
        fields = [line_of(request_lines, request_id) for request_id in ("off-1", "off-2")]
    finally:
        registry, servicer.metrics = servicer.metrics.registry, recording
    assert [(f["status"], f["completion_tokens"]) for f in fields] == [("OK", 3), ("OK", 3)]
    assert all(0 <= f["ttft_s"] <= f["e2e_s"] for f in fields)
    samples = {(s.name, frozenset(s.labels.items())): s.value for family in registry.collect() for s in family.samples}
    counted = {name: number for (name, _), number in samples.items()
               if number and (name.endswith(("_total", "_count")) or name.endswith("_sum"))}
    assert counted == {}


@pytest.mark.parametrize(("setup", "request_kwargs", "code"), [
    ("queue_full", {}, "RESOURCE_EXHAUSTED"),
    (None, {"max_tokens": 0}, "INVALID_ARGUMENT"),
])
def test_error_statuses_are_counted_by_code(stub, engine: FakeEngine, metrics_port: int, request_lines,
                                            setup: str | None, request_kwargs: dict, code: str) -> None:
    if setup:
        setattr(engine, setup, True)
    before = value(scrape(metrics_port), "nanovllm_request_failure_total", code=code)
    with pytest.raises(grpc.RpcError) as error:
        stub.Generate(build_request("hello", request_id=f"bad-{code}", **request_kwargs))
    assert error.value.code().name == code
    assert line_of(request_lines, f"bad-{code}")["status"] == code
    assert value(scrape(metrics_port), "nanovllm_request_failure_total", code=code) == before + 1


@pytest.mark.parametrize("code", ["CANCELLED", "DEADLINE_EXCEEDED"])
def test_cancelled_and_expired_streams_are_counted(stub, engine: FakeEngine, metrics_port: int, request_lines,
                                                   code: str) -> None:
    engine.hang_after_first_output = True
    before = value(scrape(metrics_port), "nanovllm_request_failure_total", code=code)
    request = build_request("hello", request_id=f"end-{code}")
    if code == "CANCELLED":
        stream = stub.GenerateStream(request)
        next(stream)
        stream.cancel()
    else:
        with pytest.raises(grpc.RpcError):
            list(stub.GenerateStream(request, timeout=0.5))
    fields = line_of(request_lines, f"end-{code}")
    assert (fields["status"], fields["completion_tokens"], fields["finish_reason"]) == (code, 1, None)
    wait_until(lambda: value(scrape(metrics_port), "nanovllm_request_failure_total", code=code) == before + 1,
               timeout=10, what=f"the {code} count")


def test_a_cancellation_at_the_clients_rounded_up_deadline_is_logged_deadline_exceeded(
        server: ServerThread, engine: FakeEngine, metrics_port: int, request_lines) -> None:
    """grpc core rounds the grpc-timeout it sends up (12.34 s goes out as 12.4 s), so its cancellation,
    sent when its own deadline passes, reaches the server before the server's deadline: here a client
    whose header says 3 s cancels after 2.95 s, as such a client does. The client saw DEADLINE_EXCEEDED;
    so must the log and the metrics."""
    engine.hang_after_first_output = True
    before = value(scrape(metrics_port), "nanovllm_request_failure_total", code="DEADLINE_EXCEEDED")
    host, port = server.target.split(":")
    request = build_request("hello", request_id="rounded-deadline").SerializeToString()
    with raw_http2.Connection(host, int(port)) as connection:
        sent = time.monotonic()
        connection.send_request("/nanovllm.generate.v1.TextGeneration/GenerateStream", [(b"grpc-timeout", b"3S")],
                                request)
        assert connection.read_until(lambda response: response.num_data_frames > 0).num_data_frames == 1
        time.sleep(max(0.0, sent + 2.95 - time.monotonic()))  # the client's own deadline, not a wait for a race
        connection.reset()
    fields = line_of(request_lines, "rounded-deadline")
    assert (fields["status"], fields["completion_tokens"]) == ("DEADLINE_EXCEEDED", 1)
    wait_until(lambda: value(scrape(metrics_port), "nanovllm_request_failure_total",
                             code="DEADLINE_EXCEEDED") == before + 1, timeout=10, what="the DEADLINE_EXCEEDED count")


def test_get_load_reports_the_engine_load(stub) -> None:
    reply = stub.GetLoad(generate_pb2.GetLoadRequest())
    assert (reply.num_requests_running, reply.num_requests_waiting, reply.num_workers_ready) == (3, 1, 1)
    assert reply.kv_cache_usage == pytest.approx(5 / 8)
    assert [(w.address, w.ready, w.num_kv_blocks, w.num_free_kv_blocks) for w in reply.workers] == [
        ("fake-worker", True, 8, 3)]


@pytest.mark.parametrize(("header", "valid"), [
    (TRACEPARENT, True),
    ("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00", True),
    ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", False),  # version ff is invalid
    ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", False),  # all-zero trace id
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", False),  # all-zero parent id
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7", False),
    (TRACEPARENT + " ", False),
    ("", False),
])
def test_traceparent_validation(header: str, valid: bool) -> None:
    assert valid_traceparent(header) == (header if valid else None)


def test_log_formats_carry_the_fields() -> None:
    record = logging.LogRecord("nanovllm.requests", logging.INFO, __file__, 1, "request finished", None, None)
    record.fields = {"request_id": 'a "b"\nstatus=OK', "prompt_tokens": 3, "ttft_s": 0.25, "finish_reason": None}
    entry = json.loads(JsonFormatter().format(record))
    assert {k: entry[k] for k in ("level", "logger", "message")} == {
        "level": "INFO", "logger": "nanovllm.requests", "message": "request finished"}
    assert {k: entry[k] for k in record.fields} == record.fields
    text = TextFormatter().format(record)
    assert "\n" not in text
    assert text.endswith('request finished request_id="a \\"b\\"\\nstatus=OK" prompt_tokens=3 ttft_s=0.250000 '
                         'finish_reason=-')
