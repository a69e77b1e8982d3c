"""The worker link end to end, against real worker processes: a worker serves one scheduler
session (a second claimant changes nothing; an explicit takeover moves it, and the old scheduler
gives up instead of fighting back); every call needs the shared secret; mTLS; a worker lost for
longer than --worker-timeout; lifecycle (port in use, SIGINT, serve when its worker dies)."""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import SamplingParams
from common.client import GenerationClient
from common.contract.config import SchedulerConfig, WorkerLinkConfig
from common.generated.nanovllm.worker.v1 import worker_pb2, worker_pb2_grpc
from common.security.worker_secret import SECRET_ENV, secret_metadata
from offline import LLM
from tests.certificates import CertificateAuthority, write_pem_files
from tests.services_harness import (
    REPO_ROOT,
    WORKER_SECRET,
    InProcessScheduler,
    cli,
    free_port,
    run_cli,
    start_scheduler,
    start_worker,
    stop,
    wait_until,
)
from tests.tiny_models import make_tiny_checkpoint, save_tiny_bpe_tokenizer

PROMPTS = [f"Request {i}: the quick brown fox" for i in range(16)]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """Big enough that 16 streams take a while on a CPU, so that the tests act mid-stream."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("link"), "qwen3", num_heads=8, num_kv_heads=4, head_dim=64,
                                hidden_size=512, intermediate_size=2048, num_layers=8, max_position_embeddings=1024)
    save_tiny_bpe_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def undisturbed(model: Path) -> list[list[int]]:
    llm = LLM(str(model), block_size=16, num_kv_blocks=256, device="cpu")
    results = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                           use_tqdm=False)
    return [result["token_ids"] for result in results]


@pytest.fixture
def worker(model: Path):
    port = free_port()
    process = start_worker(model, port)
    wait_until(lambda: health(port) == "SERVING", timeout=120, what="the worker")
    yield port, process
    stop(process)


def health(port: int) -> str:
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError as error:
        return error.code().name


def call_code(function, request, **kwargs) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as error:
        function(request, timeout=30, **kwargs)
    return error.value.code(), error.value.details()


def tokens_of(deltas) -> list[int]:
    return [token for delta in deltas for token in delta.token_ids]


def finish_streams(firsts: list, streams: list) -> list[list[int]]:
    with ThreadPoolExecutor(len(streams)) as pool:
        return list(pool.map(lambda i: tokens_of([firsts[i], *streams[i]]), range(len(streams))))


def test_a_second_claimant_and_unauthenticated_callers_change_nothing(model, worker, undisturbed, caplog) -> None:
    port, _ = worker
    first = InProcessScheduler(model, port).start()
    client = GenerationClient(first.target, timeout=300)
    second = None
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = worker_pb2_grpc.WorkerStub(channel)
    try:
        client.wait_ready(timeout=120)
        streams = [client.stream(p, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True) for p in PROMPTS]
        firsts = [next(stream) for stream in streams]  # all 16 are running now
        step = worker_pb2.StepRequest(step_id=1, session_id="intruder", new_sequences=[worker_pb2.NewSequence(
            seq_id=1, token_ids=[1, 2, 3], num_tokens=3, num_prompt_tokens=3, block_table=[0])])
        claim = worker_pb2.InitCacheRequest(num_kv_blocks=1, session_id="intruder")
        # No secret, or a wrong one: UNAUTHENTICATED for every method, Describe included (no model path).
        for metadata in ((), secret_metadata("wrong-secret-0123456789")):
            for function, request in ((stub.Describe, worker_pb2.DescribeRequest()), (stub.InitCache, claim),
                                      (stub.Step, step), (stub.Release, worker_pb2.ReleaseRequest(seq_ids=[1])),
                                      (stub.Heartbeat, worker_pb2.HeartbeatRequest(session_id="intruder")),
                                      (stub.EndSession, worker_pb2.EndSessionRequest(session_id="intruder"))):
                code, details = call_code(function, request, metadata=metadata)
                assert code == grpc.StatusCode.UNAUTHENTICATED and str(model) not in details
        assert health(port) == "SERVING"  # health stays open for container checks
        # With the secret but another session: the claim is refused, its steps and releases too.
        metadata = secret_metadata(WORKER_SECRET)
        code, details = call_code(stub.InitCache, claim, metadata=metadata)
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "another scheduler session" in details
        assert call_code(stub.Step, step, metadata=metadata)[0] == grpc.StatusCode.ABORTED
        release = worker_pb2.ReleaseRequest(seq_ids=list(range(1, 64)), session_id="intruder")
        assert call_code(stub.Release, release, metadata=metadata)[0] == grpc.StatusCode.ABORTED
        for function, request in ((stub.Heartbeat, worker_pb2.HeartbeatRequest(session_id="intruder")),
                                  (stub.EndSession, worker_pb2.EndSessionRequest(session_id="intruder"))):
            assert call_code(function, request, metadata=metadata)[0] == grpc.StatusCode.ABORTED
        # A whole second scheduler: its claim is refused, it never becomes ready.
        caplog.set_level(logging.ERROR, logger="scheduler_service.lanes.worker_lane")
        second = InProcessScheduler(model, port).start()
        wait_until(lambda: any("refused us" in r.getMessage() and "FAILED_PRECONDITION" in r.getMessage()
                               for r in caplog.records), timeout=60, what="the second scheduler's refused claim")
        assert finish_streams(firsts, streams) == undisturbed
        assert second.engine is not None and not second.engine.is_ready
    finally:
        channel.close()
        client.close()
        first.stop()
        if second is not None:
            second.stop()


def test_a_wrong_step_id_does_not_reveal_the_next_one(worker) -> None:
    port, _ = worker
    metadata = secret_metadata(WORKER_SECRET)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        stub.InitCache(worker_pb2.InitCacheRequest(num_kv_blocks=4, session_id="owner"), metadata=metadata, timeout=60)
        for step_id in (1, 2):
            stub.Step(worker_pb2.StepRequest(step_id=step_id, session_id="owner"), metadata=metadata, timeout=60)
        code, details = call_code(stub.Step, worker_pb2.StepRequest(step_id=1, session_id="owner"), metadata=metadata)
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert details == "step_id: 1 was already used"  # says nothing of 3


def test_a_body_that_does_not_parse_is_invalid_argument_and_harms_nothing(worker) -> None:
    """An authenticated caller's garbage Step: INVALID_ARGUMENT naming the request (not grpcio's
    UNKNOWN), and the session goes on."""
    port, _ = worker
    metadata = secret_metadata(WORKER_SECRET)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        stub.InitCache(worker_pb2.InitCacheRequest(num_kv_blocks=4, session_id="owner"), metadata=metadata, timeout=60)
        raw_step = channel.unary_unary("/nanovllm.worker.v1.Worker/Step", request_serializer=None,
                                       response_deserializer=None)
        code, details = call_code(raw_step, b"\xff\xff\xff not protobuf", metadata=metadata)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert details.startswith("request: not a valid protobuf message")
        stub.Step(worker_pb2.StepRequest(step_id=1, session_id="owner"), metadata=metadata, timeout=60)


def test_takeover_moves_the_worker_and_the_old_scheduler_gives_up(model, worker, undisturbed) -> None:
    port, _ = worker
    first = InProcessScheduler(model, port, SchedulerConfig(worker_timeout_s=2)).start()
    first_client = GenerationClient(first.target, timeout=300)
    second = None
    try:
        first_client.wait_ready(timeout=120)
        stream = first_client.stream(PROMPTS[0], temperature=0, max_tokens=900, ignore_eos=True)
        next(stream)
        second = InProcessScheduler(model, port, link=WorkerLinkConfig(WORKER_SECRET, takeover=True)).start()
        second_client = GenerationClient(second.target, timeout=300)
        second_client.wait_ready(timeout=120)
        # The old scheduler sees its session gone, cannot reclaim it, and fails its request once
        # its worker timeout passes, rather than taking the worker back.
        with pytest.raises(grpc.RpcError) as error:
            list(stream)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE and "worker lost" in error.value.details()
        results = [second_client.generate(p, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True).token_ids
                   for p in PROMPTS[:4]]
        assert results == undisturbed[:4]
        assert not first.engine.is_ready
        second_client.close()
    finally:
        first_client.close()
        first.stop()
        if second is not None:
            second.stop()


def test_requests_end_unavailable_when_no_worker_is_back_within_the_timeout(model, worker) -> None:
    port, process = worker
    scheduler = InProcessScheduler(model, port, SchedulerConfig(worker_timeout_s=1)).start()
    client = GenerationClient(scheduler.target, timeout=300)
    try:
        client.wait_ready(timeout=120)
        stream = client.stream(PROMPTS[0], temperature=0, max_tokens=900, ignore_eos=True)
        next(stream)
        process.send_signal(signal.SIGKILL)
        process.wait()
        with pytest.raises(grpc.RpcError) as error:
            list(stream)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE and "worker lost" in error.value.details()
        assert scheduler.engine.num_unfinished == 0
    finally:
        client.close()
        scheduler.stop()


def test_mutual_tls_between_scheduler_and_worker(model, tmp_path, undisturbed) -> None:
    ca = CertificateAuthority("test CA")
    ca_file = tmp_path / "ca.pem"
    ca_file.write_bytes(ca.cert_pem)
    server_cert, server_key = write_pem_files(tmp_path, "worker", ca.issue("worker", server=True))
    client_cert, client_key = write_pem_files(tmp_path, "scheduler", ca.issue("scheduler", server=False))
    port = free_port()
    process = start_worker(model, port, "--tls-cert", server_cert, "--tls-key", server_key,
                           "--tls-client-ca", str(ca_file))
    link = WorkerLinkConfig(WORKER_SECRET, client_cert, client_key, str(ca_file))
    scheduler = InProcessScheduler(model, port, link=link).start()
    client = GenerationClient(scheduler.target, timeout=300)
    try:
        client.wait_ready(timeout=120)
        result = client.generate(PROMPTS[0], temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        assert result.token_ids == undisturbed[0]
        # Without a client certificate, or in plaintext, no call gets through, secret or not.
        metadata = secret_metadata(WORKER_SECRET)
        no_client_cert = grpc.ssl_channel_credentials(root_certificates=ca.cert_pem)
        for channel in (grpc.secure_channel(f"127.0.0.1:{port}", no_client_cert),
                        grpc.insecure_channel(f"127.0.0.1:{port}")):
            with channel:
                code, _ = call_code(worker_pb2_grpc.WorkerStub(channel).Describe, worker_pb2.DescribeRequest(),
                                    metadata=metadata)
                assert code == grpc.StatusCode.UNAVAILABLE
    finally:
        client.close()
        scheduler.stop()
        stop(process)


def run_health(target: str, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    """`nanovllm health` with a 60 s --timeout and no worker secret, and the seconds it took."""
    env = {key: value for key, value in os.environ.items() if key != SECRET_ENV}
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "launch.cli", "health", "--target", target, "--timeout", "60",
                             *args], capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=120)
    return result, time.monotonic() - started


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mtls"])
def test_health_command_checks_a_tls_worker(model, tmp_path, mutual) -> None:
    """Health on a worker needs no secret, only the port's TLS: its CA and, under mTLS, a client
    certificate. Dialed in plaintext, or without the client certificate, it fails at once (not at
    its --timeout) with one line saying how it dialed."""
    ca = CertificateAuthority("test CA")
    ca_file = tmp_path / "ca.pem"
    ca_file.write_bytes(ca.cert_pem)
    server_cert, server_key = write_pem_files(tmp_path, "worker", ca.issue("worker", server=True))
    client_cert, client_key = write_pem_files(tmp_path, "prober", ca.issue("prober", server=False))
    client_files = ["--client-cert", client_cert, "--client-key", client_key] if mutual else []
    port = free_port()
    process = start_worker(model, port, "--tls-cert", server_cert, "--tls-key", server_key,
                           *(["--tls-client-ca", str(ca_file)] if mutual else []))
    target = f"127.0.0.1:{port}"
    try:
        # A port without --tls-client-ca never asks for the client certificate.
        with GenerationClient(target, ca_cert=ca_file, client_cert=client_cert, client_key=client_key) as client:
            client.wait_ready(timeout=120)
        result, _ = run_health(target, "--ca-cert", str(ca_file), *client_files)
        assert (result.returncode, result.stdout, result.stderr) == (0, f"{target}: SERVING\n", "")

        failures = [(run_health(target), "(dialed in plaintext: a TLS port needs --ca-cert; mTLS also --client-cert")]
        if mutual:
            failures.append((run_health(target, "--ca-cert", str(ca_file)), "(dialed with TLS: a plaintext port "
                             "takes no --ca-cert; mTLS needs --client-cert, --client-key)"))
        for (result, seconds), hint in failures:
            assert (result.returncode, result.stdout) == (1, "")
            assert result.stderr.startswith(f"{target}: UNAVAILABLE {hint}") and result.stderr.count("\n") == 1
            assert seconds < 30  # refused by the handshake, not waiting for the 60 s deadline
    finally:
        stop(process)


def test_health_command_with_tls_to_a_plaintext_worker_says_how_it_dialed(worker, tmp_path) -> None:
    port, _ = worker
    ca_file = tmp_path / "ca.pem"
    ca_file.write_bytes(CertificateAuthority("test CA").cert_pem)
    result, seconds = run_health(f"127.0.0.1:{port}", "--ca-cert", str(ca_file))
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.startswith(f"127.0.0.1:{port}: UNAVAILABLE (dialed with TLS: a plaintext port takes no "
                                    "--ca-cert") and result.stderr.count("\n") == 1  # gRPC's own log line muted
    assert seconds < 30


def test_worker_on_a_port_in_use_exits_naming_the_port(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")  # a model folder that passes the start-up checks, never loaded
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = run_cli("worker", "--model", str(tmp_path), "--port", str(port), timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"nanovllm worker: cannot listen on 127.0.0.1:{port}: Address already in use")


def test_worker_without_a_secret_refuses_to_start() -> None:
    env = {key: value for key, value in os.environ.items() if key != SECRET_ENV}
    result = subprocess.run([sys.executable, "-m", "launch.cli", "worker", "--model", "unused"], capture_output=True,
                            text=True, cwd=REPO_ROOT, env=env, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("nanovllm worker: worker secret: none given; set NANOVLLM_WORKER_SECRET")


def test_sigint_stops_the_worker_like_sigterm(worker) -> None:
    _, process = worker
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=60) == 0


def test_scheduler_with_its_worker_gone_does_not_wait_the_grace(model, worker) -> None:
    worker_port, process = worker
    port = free_port()
    scheduler = start_scheduler(worker_port, port, "--shutdown-grace", "600", "--worker-timeout", "600")
    client = GenerationClient(f"127.0.0.1:{port}", timeout=300)
    try:
        client.wait_ready(timeout=120)
        stream = client.stream(PROMPTS[0], temperature=0, max_tokens=900, ignore_eos=True)
        next(stream)
        process.send_signal(signal.SIGKILL)
        process.wait()
        scheduler.send_signal(signal.SIGINT)
        with pytest.raises(grpc.RpcError) as error:
            list(stream)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE and "worker lost" in error.value.details()
        assert scheduler.wait(timeout=120) == 0  # far less than the 600 s grace
    finally:
        client.close()
        stop(scheduler)


def test_serve_exits_with_the_workers_error_when_it_dies_at_start_up(tmp_path) -> None:
    # A folder that passes the start-up checks (it has a config.json) but that no worker can load.
    (tmp_path / "config.json").write_text('{"model_type": "no-such-architecture"}')
    result = run_cli("serve", "--model", str(tmp_path), "--port", str(free_port()), "--device", "cpu", timeout=300)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("nanovllm serve: the worker exited with code ") and "no-such-architecture" in last


def test_serve_gives_its_worker_a_random_secret_through_the_environment(model, tmp_path) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as output:
        serve = cli("serve", "--model", str(model), "--port", str(port), "--device", "cpu", "--block-size", "16",
                    "--num-kv-blocks", "64", stderr=output)
    client = GenerationClient(f"127.0.0.1:{port}", timeout=300)
    try:
        client.wait_ready(timeout=180)
        assert client.generate(PROMPTS[0], temperature=0, max_tokens=4, ignore_eos=True).usage.completion_tokens == 4
        worker_pid = int(Path(f"/proc/{serve.pid}/task/{serve.pid}/children").read_text().split()[0])
        environment = dict(entry.split("=", 1) for entry in
                           Path(f"/proc/{worker_pid}/environ").read_text().split("\0") if "=" in entry)
        secret = environment[SECRET_ENV]
        assert len(secret) == 64 and secret != WORKER_SECRET  # its own, not the caller's
        for pid in (serve.pid, worker_pid):
            assert secret not in Path(f"/proc/{pid}/cmdline").read_text()
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=120) == 0
        assert secret not in log.read_text()
    finally:
        client.close()
        stop(serve)
