"""What the real processes write under hostile input. `nanovllm serve` runs with TLS, an API key, a
metrics port and `--log-format json --log-level DEBUG` (gRPC core at INFO), its stderr (the worker's
forwarded into it) in a file. It gets raw HTTP/2 calls whose metadata holds the API key and the
worker secret followed by bytes gRPC does not allow, failed TLS handshakes, hostile request ids and
a call whose deadline passes, a request id that echoes the key; then it is stopped. Every line it
wrote is one JSON object, gRPC core's included; no line holds a secret; the worker's environment
holds its secret, not the API key.
A scheduler alone (nothing to load) shows gRPC core's verbosity: ERROR unless GRPC_VERBOSITY says."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from common.client import GenerationClient, build_request
from common.generated.nanovllm.generate.v1 import generate_pb2_grpc
from common.security.worker_secret import SECRET_ENV
from tests import raw_http2
from tests.certificates import CertificateAuthority, write_pem_files
from tests.metrics_scrape import scrape, value
from tests.services_harness import REPO_ROOT, free_port, wait_until
from tests.test_services_e2e import model_with_tokenizer

API_KEY = "log-guarantees-api-key-0123456789"
PUBLIC_METHOD = "/nanovllm.generate.v1.TextGeneration/GetModelInfo"
WORKER_METHOD = "/nanovllm.worker.v1.Worker/Describe"
UNAUTHENTICATED, INVALID_ARGUMENT = grpc.StatusCode.UNAUTHENTICATED.value[0], grpc.StatusCode.INVALID_ARGUMENT.value[0]
# What follows "Bearer <secret>" in each hostile authorization value.
HOSTILE_TAILS = [b"\xff", b"\x00", b"\r\nx-injected: 1", b"\r\n", b"a" * 65_536]
HOSTILE_REQUEST_IDS = ["line\u2028separator", "paragraph\u2029separator", "next\u0085line", "new\nline",
                       'quote"}{"level": "ERROR", "message": "forged"}']
LINE_BREAKS = ("\u2028", "\u2029", "\u0085")


def cli_process(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with log.open("wb") as stderr:
        return subprocess.Popen([sys.executable, "-m", "launch.cli", *args], cwd=REPO_ROOT, stderr=stderr, env=env)


def stop(process: subprocess.Popen) -> int:
    """SIGTERM, then the exit status; SIGKILL (and a failure) if it has not exited within a minute."""
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise


def log_entries(log: Path) -> list[dict]:
    """Every line of the log as a JSON object; fails on a line that is not one."""
    entries = []
    for line in log.read_text(encoding="utf-8").split("\n")[:-1]:  # the file ends with a line break
        assert not any(mark in line for mark in LINE_BREAKS), line
        entry = json.loads(line)
        assert isinstance(entry, dict), line
        entries.append(entry)
    return entries


def tls_files(folder: Path) -> tuple[CertificateAuthority, str, str]:
    ca = CertificateAuthority("log test CA")
    cert, key = write_pem_files(folder, "server", ca.issue("localhost", server=True))
    (folder / "ca.pem").write_bytes(ca.cert_pem)
    return ca, cert, key


def key_body_lines(key_path: str) -> list[str]:
    """The base64 lines of a PEM private key (what a log line quoting the key would hold)."""
    return [line for line in Path(key_path).read_text().splitlines() if line and not line.startswith("-----")]


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def wait_serving(process: subprocess.Popen, target: str, ca_path: Path, log: Path) -> None:
    """Waits until the server at target reports SERVING; fails at once if the process ends first."""
    def serving() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"exited with {process.returncode}: {log.read_text()[-2000:]}")
        with GenerationClient(target, ca_cert=ca_path, api_key=API_KEY, timeout=2) as client:
            try:
                return client.health_status() == "SERVING"
            except grpc.RpcError:
                return False

    wait_until(serving, timeout=180, what=f"{target} SERVING")


@dataclass
class Run:
    """What one served run saw and wrote."""

    log: Path
    key_path: str
    worker_environ: dict[str, str] = field(default_factory=dict)
    public_codes: list[int | None] = field(default_factory=list)
    other_header_code: int | None = None
    unknown_method_code: int | None = None
    worker_codes: list[int | None] = field(default_factory=list)
    handshake_codes: list[grpc.StatusCode] = field(default_factory=list)
    deadline_code: grpc.StatusCode | None = None
    metrics: dict = field(default_factory=dict)
    exit_code: int | None = None

    @property
    def secrets(self) -> list[str]:
        return [API_KEY, self.worker_environ[SECRET_ENV], *key_body_lines(self.key_path)]


def hostile_public_calls(run: Run, port: int, ca_pem: bytes) -> None:
    bearer = f"Bearer {API_KEY}".encode()
    for tail in HOSTILE_TAILS:
        response = raw_http2.call("127.0.0.1", port, PUBLIC_METHOD, [(b"authorization", bearer + tail)], tls_ca=ca_pem)
        run.public_codes.append(response.grpc_status)
    run.other_header_code = raw_http2.call("127.0.0.1", port, PUBLIC_METHOD, [
        (b"authorization", bearer), (b"x-note", API_KEY.encode() + b"\xff")], tls_ca=ca_pem).grpc_status
    # A method path the server does not know, holding the key (UTF-8: a path that is not stops grpcio's
    # serving loop, a grpcio bug no interceptor can reach).
    run.unknown_method_code = raw_http2.call("127.0.0.1", port, f"/{API_KEY}/{API_KEY}\u00ff", [],
                                             tls_ca=ca_pem).grpc_status


def hostile_worker_calls(run: Run, port: int) -> None:
    bearer = f"Bearer {run.worker_environ[SECRET_ENV]}".encode()
    for tail in HOSTILE_TAILS:
        run.worker_codes.append(raw_http2.call("127.0.0.1", port, WORKER_METHOD,
                                               [(b"authorization", bearer + tail)]).grpc_status)


def failed_handshakes(run: Run, port: int) -> None:
    """Plaintext gRPC against the TLS port, then TLS trusting another CA."""
    with GenerationClient(f"127.0.0.1:{port}", api_key=API_KEY, timeout=5) as plaintext, \
            pytest.raises(grpc.RpcError) as refused:
        plaintext.health_status()
    run.handshake_codes.append(refused.value.code())
    other = CertificateAuthority("another CA")
    (run.log.parent / "other_ca.pem").write_bytes(other.cert_pem)
    with GenerationClient(f"localhost:{port}", ca_cert=run.log.parent / "other_ca.pem", timeout=5) as wrong_ca, \
            pytest.raises(grpc.RpcError) as refused:
        wrong_ca.health_status()
    run.handshake_codes.append(refused.value.code())


def requests_with_hostile_ids_and_a_deadline(run: Run, port: int, ca_path: Path) -> None:
    with GenerationClient(f"localhost:{port}", ca_cert=ca_path, api_key=API_KEY, timeout=60) as client:
        for request_id in [*HOSTILE_REQUEST_IDS, f"echo-{API_KEY}"]:  # a client may echo its key anywhere
            client.generate("hello", request_id=request_id, max_tokens=2)
    credentials = grpc.ssl_channel_credentials(ca_path.read_bytes())
    with grpc.secure_channel(f"localhost:{port}", credentials) as channel:
        stream = generate_pb2_grpc.TextGenerationStub(channel).GenerateStream(
            build_request("hello", request_id="deadline-passes", max_tokens=3800, ignore_eos=True),
            metadata=[("authorization", f"Bearer {API_KEY}")], timeout=1.5)
        with pytest.raises(grpc.RpcError) as ended:
            for _ in stream:
                pass
        run.deadline_code = ended.value.code()


def metrics_after_the_deadline(metrics_port: int) -> dict:
    """The service's metrics once it has recorded the call whose deadline passed: the client sees
    DEADLINE_EXCEEDED when its own timer fires, the server a moment later, when it notices the
    cancellation (a scrape at once missed it on a loaded CI machine)."""
    samples: dict = {}

    def recorded() -> bool:
        samples.update(scrape(metrics_port))
        return value(samples, "nanovllm_request_failure_total", code="DEADLINE_EXCEEDED") > 0

    wait_until(recorded, 30, "the passed deadline in nanovllm_request_failure_total")
    return samples


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    folder = tmp_path_factory.mktemp("log_guarantees")
    model = model_with_tokenizer(folder, num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64,
                                 max_position_embeddings=4096)
    ca, cert, key = tls_files(folder)
    port, metrics_port = free_port(), free_port()
    env = {**os.environ, "NANOVLLM_API_KEYS": API_KEY, "GRPC_VERBOSITY": "INFO", "PYTHONUNBUFFERED": "1"}
    env.pop(SECRET_ENV, None)
    result = Run(folder / "serve.log", key)
    serve = cli_process(["--log-level", "DEBUG", "--log-format", "json", "serve", "--model", str(model),
                         "--port", str(port), "--metrics-port", str(metrics_port), "--tls-cert", cert,
                         "--tls-key", key, "--device", "cpu", "--block-size", "16", "--num-kv-blocks", "512"],
                        result.log, env)
    try:
        wait_serving(serve, f"localhost:{port}", folder / "ca.pem", result.log)
        (worker,) = children(serve.pid)
        environ = Path(f"/proc/{worker}/environ").read_bytes().split(b"\0")
        result.worker_environ = dict(item.decode().partition("=")[::2] for item in environ if item)
        argv = Path(f"/proc/{worker}/cmdline").read_bytes().decode().split("\0")
        worker_port = int(argv[argv.index("--port") + 1])
        hostile_public_calls(result, port, ca.cert_pem)
        hostile_worker_calls(result, worker_port)
        failed_handshakes(result, port)
        requests_with_hostile_ids_and_a_deadline(result, port, folder / "ca.pem")
        result.metrics = metrics_after_the_deadline(metrics_port)
    finally:
        result.exit_code = stop(serve)
    yield result


def test_the_worker_gets_its_secret_and_not_the_api_keys(run: Run) -> None:
    assert "NANOVLLM_API_KEYS" not in run.worker_environ
    assert len(run.worker_environ[SECRET_ENV]) == 64
    assert run.worker_environ["GRPC_VERBOSITY"] == "INFO"  # the rest of serve's environment passes


def test_hostile_metadata_is_refused_on_both_ports(run: Run) -> None:
    refused = value(run.metrics, "nanovllm_request_failure_total", code="UNAUTHENTICATED")
    assert (run.public_codes, run.worker_codes, run.other_header_code, run.unknown_method_code, refused) == (
        [UNAUTHENTICATED] * len(HOSTILE_TAILS), [UNAUTHENTICATED] * len(HOSTILE_TAILS),
        INVALID_ARGUMENT,  # a valid key, and another header gRPC does not allow
        UNAUTHENTICATED, len(HOSTILE_TAILS) + 1)


def test_no_line_holds_a_secret(run: Run) -> None:
    text = run.log.read_text(encoding="utf-8", errors="replace")
    assert [secret for secret in run.secrets if secret in text] == []
    assert "Invalid encoding" not in text


def test_every_line_is_one_json_object_the_workers_and_the_exits_included(run: Run) -> None:
    entries = log_entries(run.log)
    assert run.exit_code == 0
    assert [e for e in entries if "exception" in e] == []
    messages = {(e["logger"], e["message"]) for e in entries}
    # The worker's lines, forwarded by serve, as the worker wrote them; the last lines of both.
    assert {("launch.worker", "worker stopping"), ("launch.scheduler", "scheduler stopped")} <= messages
    refusals = [e for e in entries if e["logger"] == "common.security.bearer_auth"]
    not_ascii = [tail for tail in HOSTILE_TAILS if not tail.isascii() or not tail.decode().isprintable()]
    assert len([e for e in refusals if e["message"].endswith("(its authorization value is not printable ASCII)")]) \
        == 2 * len(not_ascii)  # one DEBUG line each, on each port
    summaries = [e["message"] for e in entries if e["logger"] == "scheduler_service.api.refused_calls"]
    assert summaries and all(" without a valid API key in the last " in message for message in summaries)


def test_failed_handshakes_come_out_as_grpc_core_records(run: Run) -> None:
    assert run.handshake_codes == [grpc.StatusCode.UNAVAILABLE] * 2
    handshakes = [e for e in log_entries(run.log) if e["logger"] == "grpc.core" and "Handshake failed" in e["message"]]
    # The plaintext client's (a client that distrusts the certificate just hangs up: no server line).
    assert [e["level"] for e in handshakes if "WRONG_VERSION_NUMBER" in e["message"]] == ["INFO"]
    assert all(e["source"].startswith("ssl_transport_security.cc:") for e in handshakes)


def test_request_ids_stay_on_their_line_and_a_passed_deadline_is_logged_as_such(run: Run) -> None:
    lines = {e["request_id"]: e for e in log_entries(run.log) if e["logger"] == "nanovllm.requests"}
    assert [lines[request_id]["status"] for request_id in HOSTILE_REQUEST_IDS] == ["OK"] * len(HOSTILE_REQUEST_IDS)
    assert lines["echo-<redacted>"]["status"] == "OK"  # the key a client echoed is redacted
    assert run.deadline_code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert lines["deadline-passes"]["status"] == "DEADLINE_EXCEEDED"
    assert value(run.metrics, "nanovllm_request_failure_total", code="DEADLINE_EXCEEDED") == 1


@pytest.mark.parametrize("verbosity", [None, "INFO"])
def test_grpc_core_verbosity_is_error_unless_grpc_verbosity_says(tmp_path: Path, verbosity: str | None) -> None:
    ca, cert, key = tls_files(tmp_path)
    port = free_port()
    env = {**os.environ, SECRET_ENV: "log-guarantees-worker-secret"}
    env.pop("GRPC_VERBOSITY", None)
    if verbosity is not None:
        env["GRPC_VERBOSITY"] = verbosity
    log = tmp_path / "scheduler.log"
    scheduler = cli_process(["--log-format", "json", "scheduler", "--worker", f"127.0.0.1:{free_port()}",
                             "--port", str(port), "--tls-cert", cert, "--tls-key", key], log, env)
    try:
        wait_until(lambda: "scheduler listening on" in log.read_text(), timeout=60, what="the scheduler listening")
        run = Run(log, key)
        failed_handshakes(run, port)
    finally:
        assert stop(scheduler) == 0
    handshakes = [e for e in log_entries(log) if e["logger"] == "grpc.core" and "Handshake failed" in e["message"]]
    assert run.handshake_codes == [grpc.StatusCode.UNAVAILABLE] * 2
    assert bool(handshakes) == (verbosity == "INFO")
