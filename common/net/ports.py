"""Ports on this host: is one free, before the slow start-up steps (loading a model, waiting for a
worker)? And a free one for a service this process starts itself."""
from __future__ import annotations

import errno
import socket


class PortInUseError(OSError):
    """An address to listen on could not be bound (another process holds it)."""


def free_port() -> int:
    """A loopback TCP port free right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def grpc_address(host: str, port: int) -> str:
    """host:port as gRPC takes it: an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def check_port_free(host: str, port: int, in_use: str) -> None:
    """Raises PortInUseError(in_use, with {address} filled in) when another socket listens on host:port.
    grpcio would find out too, but would log a multi-line error of its own first; this way the
    operator reads one line, and start-up can check before the slow steps rather than after."""
    if port == 0 or host.startswith("/"):  # a port picked at the bind, or a unix socket path
        return
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return  # grpcio reports the bad address
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpcio: TIME_WAIT is no conflict
            try:
                probe.bind(sockaddr)
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    raise PortInUseError(in_use.format(address=grpc_address(host, port))) from error
