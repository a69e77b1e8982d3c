"""Ports on this host: is one free, before the slow start-up steps (loading a model, waiting for a
worker)? Binding a server to one, and a free one for a service this process starts itself."""
from __future__ import annotations

import errno
import socket

import grpc

# What the operator reads when a port's address is taken ({address} as grpc_address writes it).
PUBLIC_PORT_IN_USE = "public port {address} is in use by another process"
WORKER_PORT_IN_USE = "cannot listen on {address}: Address already in use"


class PortInUseError(OSError):
    """An address to listen on could not be bound (another process holds it)."""


def free_port() -> int:
    """A loopback TCP port free right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def grpc_address(host: str, port: int) -> str:
    """host:port as gRPC takes it: an IPv6 host in brackets, a unix socket path (host) as unix:path."""
    if host.startswith("/"):
        return f"unix:{host}"
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


def listen(server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None,
           in_use: str) -> int:
    """Binds server to host:port (or the unix socket path host), over TLS unless credentials is None;
    returns the bound port. Raises PortInUseError (in_use) when the address is taken or not this host's."""
    check_port_free(host, port, in_use)
    address = grpc_address(host, port)
    try:
        return (server.add_secure_port(address, credentials) if credentials is not None
                else server.add_insecure_port(address))
    except RuntimeError as error:  # grpcio says only "Failed to bind to address"
        raise PortInUseError(f"{in_use.format(address=address)} (or not an address of this machine)") from error
