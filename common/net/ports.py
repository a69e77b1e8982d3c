"""Ports on this host: is one free, before the slow start-up steps (loading a model, waiting for a
worker)? Binding a server to one, and a free one for a service this process starts itself.

A loopback host (127.0.0.1 or localhost) means both loopbacks where the machine has IPv6: the port
is bound on 127.0.0.1 and on ::1, so that clients resolving localhost to ::1 (and `[::1]:PORT`)
reach it as well (listen_hosts)."""
from __future__ import annotations

import errno
import functools
import logging
import socket
from collections.abc import Callable

import grpc

# What the operator reads when a port's address is taken ({address} as grpc_address writes it).
PUBLIC_PORT_IN_USE = "public port {address} is in use by another process"
WORKER_PORT_IN_USE = "cannot listen on {address}: Address already in use"
METRICS_PORT_IN_USE = "metrics port {address} (--metrics-port) is in use by another process"

LOOPBACK_HOSTS = ("127.0.0.1", "localhost")

logger = logging.getLogger(__name__)


class PortInUseError(OSError):
    """An address to listen on could not be bound (another process holds it)."""


def free_port() -> int:
    """A loopback TCP port free right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@functools.cache
def has_ipv6_loopback() -> bool:
    """Whether this machine can bind ::1 (IPv6 may be disabled, e.g. in some containers)."""
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


def listen_hosts(host: str) -> list[str]:
    """The addresses a server given `host` binds: both loopbacks for a loopback host (IPv4 first;
    ::1 only where the machine has IPv6), else host itself."""
    if host in LOOPBACK_HOSTS:
        return ["127.0.0.1", "::1"] if has_ipv6_loopback() else ["127.0.0.1"]
    return [host]


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
    infos = []
    for address in listen_hosts(host):
        try:
            infos += socket.getaddrinfo(address.strip("[]"), port, type=socket.SOCK_STREAM)
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


def listen(server: grpc.aio.Server, host: str, port: int,
           credentials: grpc.ServerCredentials | Callable[[], grpc.ServerCredentials] | None, in_use: str) -> int:
    """Binds server to host:port (or the unix socket path host), over TLS unless credentials is None;
    a loopback host on both loopbacks (listen_hosts). Returns the bound port. Raises PortInUseError
    (in_use, naming host:port as given) when the address is taken or not this host's.

    `credentials` may be a function that makes them, called once per address: reloading credentials
    (common.security.reloading_tls) serve one address each."""
    check_port_free(host, port, in_use)

    def bind(address: str) -> int:
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials() if callable(credentials) else credentials)

    first, *others = listen_hosts(host)
    try:
        bound = bind(grpc_address(first, port))
    except RuntimeError as error:  # grpcio says only "Failed to bind to address"
        raise PortInUseError(f"{in_use.format(address=grpc_address(host, port))} "
                             "(or not an address of this machine)") from error
    for other in others:  # the same port on ::1
        try:
            bind(grpc_address(other, bound))
        except RuntimeError as error:
            if port:  # checked free a moment ago: another process took it since
                raise PortInUseError(in_use.format(address=grpc_address(other, bound))) from error
            # A port the OS picked for 127.0.0.1 may be taken on ::1: that server stays IPv4 only.
            logger.debug("port %d is taken on %s; listening on %s only", bound, other, first)
    return bound
