"""`nanovllm health` says in one line what went wrong: a certificate its CA does not sign (no
plaintext/mTLS hint, no gRPC ": OK" tail), a port that is no gRPC server (an HTTP port such as the
metrics port), nothing listening."""
from __future__ import annotations

import http.server
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2_grpc

from common.client import connection_failure
from tests.certificates import CertificateAuthority, write_pem_files
from tests.services_harness import REPO_ROOT

NOT_GRPC = ("UNAVAILABLE: not a gRPC server: the port answers, but not in HTTP/2 (an HTTP port such as the "
            "metrics port?)")


class FakeError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


PREFIX = "failed to connect to all addresses; last error: "
WRONG_CA = (PREFIX + "UNKNOWN: ipv4:127.0.0.1:1: Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: "
            "error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: unable to get local issuer "
            "certificate: OK")


@pytest.mark.parametrize(("code", "details", "tls", "client_cert", "line"), [
    (grpc.StatusCode.UNAVAILABLE, WRONG_CA, True, False,
     "UNAVAILABLE: TLS: the server's certificate is not signed by the CA of --ca-cert (unable to get local issuer "
     "certificate)"),
    (grpc.StatusCode.UNAVAILABLE, PREFIX + "UNAVAILABLE: ipv4:127.0.0.1:1: Failed parsing HTTP/2 (Expected "
     "SETTINGS frame as the first frame, got frame type 79)", False, False, NOT_GRPC),
    (grpc.StatusCode.UNAVAILABLE, PREFIX + "UNKNOWN: ipv4:127.0.0.1:1: Failed to connect to remote host: "
     "Connection refused", False, False, "UNAVAILABLE: nothing listens there (UNKNOWN: ipv4:127.0.0.1:1: Failed "
     "to connect to remote host: Connection refused)"),
    (grpc.StatusCode.UNAVAILABLE, PREFIX + "UNKNOWN: ipv4:127.0.0.1:1: Tls handshake failed (TSI_PROTOCOL_FAILURE): "
     "SSL_ERROR_SSL: error:100000f7:SSL routines:OPENSSL_internal:WRONG_VERSION_NUMBER: Invalid certificate "
     "verification context: OK", True, False,
     "UNAVAILABLE (dialed with TLS: a plaintext port takes no --ca-cert): the port does not speak TLS"),
    (grpc.StatusCode.UNAVAILABLE, PREFIX + "UNAVAILABLE: ipv4:127.0.0.1:1: Socket closed", False, False,
     "UNAVAILABLE (dialed in plaintext: a TLS port needs --ca-cert; mTLS also --client-cert, --client-key): "
     "UNAVAILABLE: ipv4:127.0.0.1:1: Socket closed"),
    (grpc.StatusCode.UNAVAILABLE, PREFIX + "UNAVAILABLE: ipv4:127.0.0.1:1: Socket closed", True, True,
     "UNAVAILABLE (dialed with mTLS: is --client-cert signed by the CA the port requires?): UNAVAILABLE: "
     "ipv4:127.0.0.1:1: Socket closed"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", False, False,
     "DEADLINE_EXCEEDED: no answer before the deadline (Deadline Exceeded)"),
    (grpc.StatusCode.UNIMPLEMENTED, "Method not found!", False, False, "UNIMPLEMENTED: Method not found!"),
])
def test_connection_failure_says_what_happened(code, details, tls, client_cert, line) -> None:
    assert connection_failure(FakeError(code, details), tls=tls, client_cert=client_cert) == line


def health(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cli", "health", "--timeout", "20", *args],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory) -> Iterator[tuple[int, Path, Path]]:
    """A TLS gRPC health server; yields its port, its CA's file and another CA's file."""
    folder = tmp_path_factory.mktemp("tls")
    ca = CertificateAuthority("server CA")
    cert, key = write_pem_files(folder, "server", ca.issue("localhost", server=True))
    (folder / "ca.pem").write_bytes(ca.cert_pem)
    (folder / "other.pem").write_bytes(CertificateAuthority("other CA").cert_pem)
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(grpc_health.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
        [(Path(key).read_bytes(), Path(cert).read_bytes())]))
    server.start()
    yield port, folder / "ca.pem", folder / "other.pem"
    server.stop(None)


@pytest.fixture(scope="module")
def http_port() -> Iterator[int]:
    """An HTTP/1.1 server, as the metrics port is."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()


def test_a_wrong_ca_is_named_without_hints_or_ok(tls_server) -> None:
    port, ca, other = tls_server
    assert health("--target", f"127.0.0.1:{port}", "--ca-cert", str(ca)).stdout == f"127.0.0.1:{port}: SERVING\n"
    result = health("--target", f"127.0.0.1:{port}", "--ca-cert", str(other))
    assert (result.returncode, result.stdout, result.stderr) == (1, "", (
        f"127.0.0.1:{port}: UNAVAILABLE: TLS: the server's certificate is not signed by the CA of --ca-cert "
        "(unable to get local issuer certificate)\n"))


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "tls"])
def test_an_http_port_is_not_a_grpc_server(http_port: int, tls_server, tls: bool) -> None:
    result = health("--target", f"127.0.0.1:{http_port}", *(["--ca-cert", str(tls_server[1])] if tls else []))
    assert (result.returncode, result.stdout, result.stderr) == (1, "", f"127.0.0.1:{http_port}: {NOT_GRPC}\n")
