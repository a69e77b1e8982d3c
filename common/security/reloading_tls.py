"""TLS for the public port, with certificates reloaded when their files change.

grpc's dynamic server credentials ask a fetcher for the certificate configuration at each new
connection's handshake: the fetcher re-reads the files only when one changed since it loaded them
last (common.security.reloading_files), so renewing a certificate needs no restart and existing
connections keep the certificate they were made with. Replace the files atomically (write
elsewhere, then rename), key before certificate, so that no handshake reads a half-written pair.
"""
from __future__ import annotations

import logging
from pathlib import Path

import grpc

from common.security.reloading_files import ReloadingFiles

logger = logging.getLogger(__name__)


def check_readable(files: dict[str, str | None]) -> None:
    """Raises ValueError naming the option whose file cannot be read (start-up: before the slow steps)."""
    for option, path in files.items():
        if path is None:
            continue
        try:
            Path(path).read_bytes()
        except OSError as error:
            raise ValueError(f"{option}: cannot read {path}: {error.__class__.__name__}") from error


class ReloadingCertificates:
    """The certificate configuration of the files at cert_path, key_path and client_ca_path (optional),
    read again whenever one of the files changes."""

    def __init__(self, cert_path: str, key_path: str, client_ca_path: str | None = None) -> None:
        paths = [cert_path, key_path, *([client_ca_path] if client_ca_path else [])]
        self.requires_client_certificate = client_ca_path is not None
        # Raises OSError (a missing file) at start-up, not at the first handshake.
        self._files = ReloadingFiles(paths, lambda: _configuration(paths))

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """grpc's certificate-config fetcher: a new configuration when the files changed, else None
        (keep the current one). A file that cannot be read keeps the current one too."""
        try:
            config = self._files.reload_if_changed()
        except OSError as error:
            logger.warning("TLS files unreadable, keeping the current certificate: %s", error)
            return None
        if config is not None:
            logger.info("TLS certificate files changed: new connections use the new certificate")
        return config

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._files.value, self.fetch, require_client_authentication=self.requires_client_certificate)


def _configuration(paths: list[str]) -> grpc.ServerCertificateConfiguration:
    cert, key, *client_ca = (Path(path).read_bytes() for path in paths)
    return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=client_ca[0] if client_ca
                                                     else None)
