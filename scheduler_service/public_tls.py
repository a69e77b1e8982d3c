"""TLS for the public port, with certificates reloaded when their files change.

grpc's dynamic server credentials ask a fetcher for the certificate configuration at each new
connection's handshake: the fetcher compares the files' modification times and sizes with those
it loaded last and re-reads them only when they differ, so renewing a certificate needs no
restart and existing connections keep the certificate they were made with. Replace the files
atomically (write elsewhere, then rename), key before certificate, so that no handshake reads a
half-written pair.
"""
from __future__ import annotations

import logging
import os
import threading

import grpc

logger = logging.getLogger(__name__)

_Signature = tuple[tuple[int, int, int], ...]


def _read(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read()


def check_readable(files: dict[str, str | None]) -> None:
    """Raises ValueError naming the option whose file cannot be read (start-up: before the slow steps)."""
    for option, path in files.items():
        if path is None:
            continue
        try:
            _read(path)
        except OSError as error:
            raise ValueError(f"{option}: cannot read {path}: {error.__class__.__name__}") from error


class ReloadingCertificates:
    """The certificate configuration of the files at cert_path, key_path and client_ca_path (optional),
    read again whenever one of the files changes."""

    def __init__(self, cert_path: str, key_path: str, client_ca_path: str | None = None) -> None:
        self.paths = [cert_path, key_path, *([client_ca_path] if client_ca_path else [])]
        self.requires_client_certificate = client_ca_path is not None
        self._lock = threading.Lock()  # the fetcher runs on grpc's threads
        self._signature = self._file_signature()
        self.initial = self._load()  # raises OSError (missing file) at start-up, not at the first handshake

    def _file_signature(self) -> _Signature:
        stats = [os.stat(path) for path in self.paths]
        return tuple((stat.st_mtime_ns, stat.st_size, stat.st_ino) for stat in stats)

    def _load(self) -> grpc.ServerCertificateConfiguration:
        cert, key, *client_ca = (_read(path) for path in self.paths)
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=client_ca[0] if client_ca
                                                         else None)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """grpc's certificate-config fetcher: a new configuration when the files changed, else None
        (keep the current one). A file that cannot be read keeps the current one too."""
        with self._lock:
            try:
                signature = self._file_signature()
                if signature == self._signature:
                    return None
                config = self._load()
            except OSError as error:
                logger.warning("TLS files unreadable, keeping the current certificate: %s", error)
                return None
            self._signature = signature
            logger.info("TLS certificate files changed: new connections use the new certificate")
            return config

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self.initial, self.fetch, require_client_authentication=self.requires_client_certificate)
