"""The scheduler names why its worker link fails, from the errors real gRPC connections give: a
certificate the CA does not sign, a worker that wants a client certificate, plaintext against TLS and
TLS against plaintext, nothing listening, a wrong secret."""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from common.contract.config import WorkerLinkConfig
from common.security.tls import server_credentials
from scheduler_service.lanes import worker_wait
from scheduler_service.lanes.worker_client import GrpcWorkerClient
from tests.certificates import CertificateAuthority, write_pem_files
from tests.services_harness import free_port

SECRET = "test-secret-0123456789abcdef"


async def first_wait_logged(address: str, link: WorkerLinkConfig, caplog: pytest.LogCaptureFixture) -> str:
    """What the wait logs first for a client of `link` dialing address."""
    client = GrpcWorkerClient(address, link, describe_timeout_s=5)
    waiting = asyncio.create_task(worker_wait.until_answered(address, link.uses_tls, client.describe))
    try:
        while not caplog.records:
            await asyncio.sleep(0.01)
    finally:
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await client.close()
    return caplog.records[0].getMessage()


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, str]:
    ca, other = CertificateAuthority("worker CA"), CertificateAuthority("another CA")
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem)
    (tmp_path / "other.pem").write_bytes(other.cert_pem)
    cert, key = write_pem_files(tmp_path, "worker", ca.issue("localhost", server=True))
    return {"ca": str(tmp_path / "ca.pem"), "other": str(tmp_path / "other.pem"), "cert": cert, "key": key}


@pytest.mark.parametrize(("server_tls", "link_files", "reason"), [
    ("tls", {"tls_ca": "other"}, "does not verify against --worker-tls-ca"),
    ("mtls", {"tls_ca": "ca"}, "it may require a client certificate"),
    ("tls", {}, "it may expect TLS (give --worker-tls-ca)"),
    ("plaintext", {"tls_ca": "ca"}, "the worker does not speak TLS"),
    (None, {}, "nothing listens there"),
])
def test_the_wait_names_why_the_link_fails(pki, caplog, server_tls, link_files, reason) -> None:
    caplog.set_level(logging.INFO, logger=worker_wait.__name__)

    async def scenario() -> str:
        port = free_port()
        server = None
        if server_tls is not None:
            server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
            address = f"127.0.0.1:{port}"
            if server_tls == "plaintext":
                server.add_insecure_port(address)
            else:
                client_ca = pki["ca"] if server_tls == "mtls" else None
                server.add_secure_port(address, server_credentials(pki["cert"], pki["key"], client_ca))
            await server.start()
        link = WorkerLinkConfig(SECRET, **{name: pki[file] for name, file in link_files.items()})
        try:
            return await first_wait_logged(f"127.0.0.1:{port}", link, caplog)
        finally:
            if server is not None:
                await server.stop(None)

    assert reason in asyncio.run(scenario())


def test_a_refused_secret_is_an_error_naming_it(caplog, monkeypatch) -> None:
    """A real worker port's refusal (tests/test_worker_link.py starts real workers) is UNAUTHENTICATED
    with the port's message; the wait logs it as a refusal, at ERROR."""
    caplog.set_level(logging.INFO, logger=worker_wait.__name__)
    error = grpc.aio.AioRpcError(grpc.StatusCode.UNAUTHENTICATED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                 "worker: missing or wrong secret")
    calls = [error]

    async def describe() -> str:
        if calls:
            raise calls.pop()
        return "answered"

    monkeypatch.setattr(worker_wait, "RETRY_S", 0)
    assert asyncio.run(worker_wait.until_answered("worker:1", False, describe)) == "answered"
    (record,) = caplog.records
    assert record.levelno == logging.ERROR
    assert record.getMessage() == ("worker worker:1 refused us: UNAUTHENTICATED: worker: missing or wrong secret; "
                                   "retrying")
