"""TLS for the public port, with certificates reloaded when their files change.

grpc's dynamic server credentials ask a fetcher for the certificate configuration at each new
connection's handshake: the fetcher re-reads the files only when one changed since it loaded them
last (common.security.reloading_files), so renewing a certificate needs no restart and existing
connections keep the certificate they were made with. Replace the files atomically (write
elsewhere, then rename), key before certificate, so that no handshake reads a half-written pair.

New files are parsed (certificate, key, whether they match, client CA) before grpc gets them:
grpc itself would keep the old certificate on files that do not parse, saying nothing, while the
log said the new one was in use. Files that cannot be read or do not parse keep the current
certificate, with one WARNING that says why (once while they stay so).
"""
from __future__ import annotations

import logging
import ssl
import threading
from pathlib import Path

import grpc

from common.security.reloading_files import ReloadingFiles

logger = logging.getLogger(__name__)


class CertificateFilesError(ValueError):
    """The files hold no certificate and key that TLS can use (the message says which)."""


def check_readable(files: dict[str, str | None]) -> None:
    """Raises ValueError naming the option whose file cannot be read (start-up: before the slow steps)."""
    for option, path in files.items():
        if path is None:
            continue
        try:
            Path(path).read_bytes()
        except OSError as error:
            raise ValueError(f"{option}: cannot read {path}: {error.__class__.__name__}") from error


def _check_certificates(option: str, pem: bytes) -> None:
    try:
        ssl.create_default_context(cadata=pem.decode("ascii"))
    except (ssl.SSLError, ValueError) as error:  # ValueError: not ASCII, so not PEM
        raise CertificateFilesError(f"{option}: not a PEM certificate") from error


def check_parses(cert_path: str, cert: bytes, key_path: str, client_ca: bytes | None) -> None:
    """Raises CertificateFilesError, naming the option, unless the certificate (PEM bytes, read from
    cert_path) and the key file parse and match, and so does the client CA (PEM bytes)."""
    _check_certificates("tls_cert", cert)
    if client_ca is not None:
        _check_certificates("tls_client_ca", client_ca)
    try:
        # An encrypted key would make OpenSSL ask for a password on the terminal: refused instead.
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_path, key_path, password=lambda: b"")
    except ssl.SSLError as error:
        problem = "not the key of tls_cert's certificate" if error.reason == "KEY_VALUES_MISMATCH" else \
            "not a PEM private key (unencrypted)"
        raise CertificateFilesError(f"tls_key: {problem}") from error


def _configuration(paths: list[str]) -> grpc.ServerCertificateConfiguration:
    cert, key, *client_ca = (Path(path).read_bytes() for path in paths)
    check_parses(paths[0], cert, paths[1], client_ca[0] if client_ca else None)
    if [cert, key, *client_ca] != [Path(path).read_bytes() for path in paths]:
        raise OSError("the files changed while they were read")  # not the bytes checked: tried again
    return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=client_ca[0] if client_ca
                                                     else None)


class ReloadingCertificates:
    """The certificate configuration of the files at cert_path, key_path and client_ca_path (optional),
    read again whenever one of the files changes."""

    def __init__(self, cert_path: str, key_path: str, client_ca_path: str | None = None) -> None:
        paths = [cert_path, key_path, *([client_ca_path] if client_ca_path else [])]
        self.requires_client_certificate = client_ca_path is not None
        # Raises OSError (a missing file) or CertificateFilesError at start-up, not at the first handshake.
        self._files = ReloadingFiles(paths, lambda: _configuration(paths))
        self._lock = threading.Lock()  # the fetchers run on grpc's threads
        self.version = 0  # how many times the files were loaded anew
        self._problem: str | None = None  # why the last reload failed: warned once while it stays so

    def reload_if_changed(self) -> None:
        """Loads the files again when one changed; files that cannot be read or do not parse keep the
        current configuration."""
        with self._lock:
            try:
                config = self._files.reload_if_changed()
            except OSError as error:
                self._warn(f"cannot be read ({error.__class__.__name__}: {error.strerror or error})")
                return
            except CertificateFilesError as error:
                self._warn(f"do not parse ({error})")
                return
            self._problem = None
            if config is not None:
                self.version += 1
                logger.info("TLS certificate files changed: new connections use the new certificate")

    def _warn(self, problem: str) -> None:
        if problem != self._problem:
            logger.warning("TLS certificate files changed but %s: keeping the current certificate", problem)
            self._problem = problem

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials for one listening address. Call it once per address: grpc hands the initial
        configuration to the first address that asks (a second address would get none and fail to
        bind), and each address learns of a new configuration through its own fetcher."""
        seen = self.version

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            """A new configuration when the files changed since this address last asked, else None."""
            nonlocal seen
            self.reload_if_changed()
            if seen == self.version:
                return None
            seen = self.version
            return self._files.value

        return grpc.dynamic_ssl_server_credentials(
            self._files.value, fetch, require_client_authentication=self.requires_client_certificate)
