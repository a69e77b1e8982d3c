"""The public port's reloading TLS certificates, through the real public server at a fixed port on
the loopback host (bound on 127.0.0.1 and ::1): both addresses serve the certificate and learn of
a renewal; files that do not parse keep the current certificate, and the log says so."""
from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.contract.config import PublicServerConfig
from common.net.ports import has_ipv6_loopback
from scheduler_service.api.public_server import PublicServer, build_public_server
from tests.certificates import CertificateAuthority, replace_file, write_pem_files
from tests.loop_thread import LoopThread
from tests.scheduler_service.public_server_harness import FakeEngine
from tests.services_harness import free_port

KEPT = "keeping the current certificate"
RENEWED = "TLS certificate files changed: new connections use the new certificate"


class TlsServer:
    def __init__(self, folder: Path) -> None:
        self.ca = CertificateAuthority("first CA")
        self.cert, self.key = write_pem_files(folder, "server", self.ca.issue("localhost", server=True))
        self.port = free_port()
        self.loop = LoopThread("tls-server")
        self.public: PublicServer = self.loop.run(self._start())
        # Both loopbacks where the machine has IPv6 (the certificate names localhost, not ::1).
        self.addresses = [f"127.0.0.1:{self.port}"] + ([f"[::1]:{self.port}"] if has_ipv6_loopback() else [])

    async def _start(self) -> PublicServer:
        config = PublicServerConfig(tls_cert=self.cert, tls_key=self.key)
        public = build_public_server(FakeEngine(None), "127.0.0.1", self.port, config=config)
        await public.start()
        return public

    def stop(self) -> None:
        self.loop.run(self.public.stop(None))
        self.loop.close()


def answers(address: str, ca: CertificateAuthority) -> bool:
    """Whether a health check over TLS, trusting `ca` alone, gets an answer (a fresh connection)."""
    credentials = grpc.ssl_channel_credentials(ca.cert_pem)
    options = [("grpc.ssl_target_name_override", "localhost")]
    with grpc.secure_channel(address, credentials, options=options) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error
            return False
    return True


@pytest.fixture
def server(tmp_path: Path) -> Iterator[TlsServer]:
    started = TlsServer(tmp_path)
    yield started
    started.stop()


def tls_messages(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "common.security.reloading_tls"]


def test_a_fixed_loopback_port_serves_tls_on_both_loopbacks_and_both_learn_of_a_renewal(server: TlsServer) -> None:
    assert [answers(address, server.ca) for address in server.addresses] == [True] * len(server.addresses)
    renewed_ca = CertificateAuthority("renewed CA")
    renewed = renewed_ca.issue("localhost", server=True)
    replace_file(Path(server.key), renewed.key)
    replace_file(Path(server.cert), renewed.cert)
    for address in server.addresses:
        assert answers(address, renewed_ca), address
        assert not answers(address, server.ca), address


def test_files_that_do_not_parse_keep_the_certificate_and_the_log_says_why(server: TlsServer,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="common.security.reloading_tls")
    address = server.addresses[0]
    replace_file(Path(server.cert), b"not a certificate\n")
    assert answers(address, server.ca)  # the handshake's fetch found the garbage: the old certificate serves
    assert answers(address, server.ca)  # and again, without a second warning
    assert tls_messages(caplog) == [
        (logging.WARNING, f"TLS certificate files changed but do not parse (tls_cert: not a PEM certificate): {KEPT}")]

    other = CertificateAuthority("other CA").issue("localhost", server=True)
    replace_file(Path(server.cert), other.cert)  # a certificate whose key is not the key file's
    assert answers(address, server.ca)
    assert tls_messages(caplog)[1:] == [
        (logging.WARNING, "TLS certificate files changed but do not parse (tls_key: not the key of tls_cert's "
                          f"certificate): {KEPT}")]

    renewed_ca = CertificateAuthority("renewed CA")
    renewed = renewed_ca.issue("localhost", server=True)
    replace_file(Path(server.key), renewed.key)
    replace_file(Path(server.cert), renewed.cert)
    assert answers(address, renewed_ca)
    assert tls_messages(caplog)[2:] == [(logging.INFO, RENEWED)]


def test_files_that_do_not_parse_at_start_up_are_refused_naming_the_option(tmp_path: Path) -> None:
    ca = CertificateAuthority("CA")
    cert, key = write_pem_files(tmp_path, "server", ca.issue("localhost", server=True))
    Path(key).write_bytes(b"-----BEGIN PRIVATE KEY-----\nnot base64\n-----END PRIVATE KEY-----\n")
    loop = LoopThread("tls-start")

    async def build() -> None:
        build_public_server(FakeEngine(None), "127.0.0.1", 0, config=PublicServerConfig(tls_cert=cert, tls_key=key))

    try:
        with pytest.raises(ValueError, match=r"^tls_key: not a PEM private key \(unencrypted\)$"):
            loop.run(build())
    finally:
        loop.close()
