"""gRPC TLS credentials from PEM files: channels to either port, and the worker port's server (the
public port's server reloads its certificates: common.security.reloading_tls).

Two functions, both reading the files once, at the call:

- server_credentials(cert, key, client_ca=None): the server's certificate chain and key; with
  client_ca, clients must present a certificate signed by it (mTLS).
- channel_credentials(ca=None, cert=None, key=None): trusts servers signed by ca (the system roots
  when None); with cert and key, presents them as this client's certificate (mTLS).

A file that cannot be read raises ValueError naming it (read_file, which the worker secret's file
uses too), so the CLI reports it as a bad option.
"""
from __future__ import annotations

from pathlib import Path

import grpc


def read_file(path: str | Path, what: str) -> bytes:
    """The bytes of the file an option (what) names; ValueError naming both when it cannot be read."""
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as error:
        raise ValueError(f"{what}: cannot read {path!r}: {error.strerror}") from None


def server_credentials(cert_file: str, key_file: str, client_ca_file: str | None = None) -> grpc.ServerCredentials:
    """TLS for a server; with client_ca_file, mutual TLS (client certificates required)."""
    pair = (read_file(key_file, "tls key"), read_file(cert_file, "tls cert"))
    client_ca = read_file(client_ca_file, "tls client ca") if client_ca_file else None
    return grpc.ssl_server_credentials([pair], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def channel_credentials(ca_file: str | Path | None = None, cert_file: str | Path | None = None,
                        key_file: str | Path | None = None) -> grpc.ChannelCredentials:
    """TLS for a client channel; cert_file and key_file (both or neither) for mutual TLS."""
    if bool(cert_file) != bool(key_file):
        raise ValueError("tls cert and key: give both or neither")
    return grpc.ssl_channel_credentials(
        root_certificates=read_file(ca_file, "tls ca") if ca_file else None,
        private_key=read_file(key_file, "tls key") if key_file else None,
        certificate_chain=read_file(cert_file, "tls cert") if cert_file else None)
