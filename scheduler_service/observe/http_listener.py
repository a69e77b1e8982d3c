"""A small HTTP/1.1 listener on asyncio, for the metrics port: GET and HEAD of a path, nothing else.

It runs in the event loop that serves gRPC, so a connection costs a socket and a coroutine, never a
thread, and everything a client can hold is bounded (HttpLimits): how many connections are open, how
long one may idle, how long a request head may take to arrive (a slowloris trickling one byte a
second is cut), how large a head may be (431 beyond), how long a reply may wait for a client that
does not read it. Request bodies are never read: a request that announces one is answered, then
its connection closed, so that its body cannot be taken for the next request.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus

from common.net.ports import PortInUseError, grpc_address, listen_hosts

logger = logging.getLogger(__name__)
BACKLOG = 4_096  # connections the kernel queues until the loop accepts them (capped by net.core.somaxconn)
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # a header name (RFC 9110, 5.6.2)
LINGER_S = 2.0  # reading what a client still sends after the reply that closes its connection


@dataclass(frozen=True)
class HttpLimits:
    """What clients can hold of the listener. At max_connections open, a new connection closes the
    one that has waited longest for its next request (a connection being answered is never closed),
    so idle connections cannot lock a scraper out; with none waiting, the new one is closed."""

    max_connections: int = 1_000
    idle_timeout_s: float = 75.0  # without a request's first byte (longer than a 1 min scrape interval)
    head_timeout_s: float = 10.0  # from a request's first byte to the blank line ending its head
    write_timeout_s: float = 10.0  # for a reply the client does not read
    max_head_bytes: int = 8_192

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.max_head_bytes < 64:
            raise ValueError(f"max_connections must be >= 1 and max_head_bytes >= 64: {self}")
        if min(self.idle_timeout_s, self.head_timeout_s, self.write_timeout_s) <= 0:
            raise ValueError(f"timeouts must be > 0: {self}")


DEFAULT_LIMITS = HttpLimits()


@dataclass(frozen=True)
class Reply:
    """What the handler answers: the status, the body (Content-Length is its length) and its type."""

    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"


Handler = Callable[[str], Reply]  # a GET's (or HEAD's) path, without its query -> the reply


class _Refused(Exception):
    """A request answered with `reply`, after which the connection closes."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply


class HttpListener:
    """Serves handler (called in the loop, one request at a time) on host:port under limits; start
    with `await listen(...)`, stop with `await close()`."""

    def __init__(self, handler: Handler, limits: HttpLimits = DEFAULT_LIMITS) -> None:
        self.handler = handler
        self.limits = limits
        self._servers: list[asyncio.Server] = []
        self._connections: set[asyncio.StreamWriter] = set()
        self._waiting: dict[asyncio.StreamWriter, None] = {}  # waiting for a request, longest first
        self._tasks: set[asyncio.Task] = set()
        self._closing = False

    @property
    def num_connections(self) -> int:
        return len(self._connections)

    async def listen(self, host: str, port: int, in_use: str) -> int:
        """Listens on host:port (a loopback host on both loopbacks: listen_hosts; port 0: one the OS
        picks); returns the port. Raises PortInUseError (in_use, naming host:port) when it is taken."""
        bound = port
        for address in listen_hosts(host):
            try:
                sock = _bound_socket(address.strip("[]"), bound)
            except OSError as error:
                if error.errno != errno.EADDRINUSE:
                    raise
                if port == 0 and self._servers:  # the OS's pick for 127.0.0.1 is taken on ::1: IPv4 only
                    continue
                await self.close()
                raise PortInUseError(in_use.format(address=grpc_address(host, port))) from None
            bound = sock.getsockname()[1]
            # A plain function, not a coroutine, as the callback: a connection is counted (or refused)
            # the moment it is made, and its task is this listener's to end.
            self._servers.append(await asyncio.start_server(self._on_connection, sock=sock, backlog=BACKLOG,
                                                            limit=self.limits.max_head_bytes))
        return bound

    async def close(self) -> None:
        """Stops listening and closes every connection (twice is harmless)."""
        self._closing = True  # connections accepted meanwhile are closed as they arrive
        for server in self._servers:
            server.close()
        for writer in list(self._connections):
            writer.transport.abort()  # their tasks see the connection lost, and end
        if self._tasks:
            _, stuck = await asyncio.wait(list(self._tasks), timeout=LINGER_S)
            for task in stuck:
                task.cancel()
        self._servers = []

    def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._connections) >= self.limits.max_connections and self._waiting:
            self._forget(next(iter(self._waiting))).transport.abort()
        if self._closing or len(self._connections) >= self.limits.max_connections:
            writer.transport.abort()
            return
        self._connections.add(writer)
        self._waiting[writer] = None
        task = asyncio.get_running_loop().create_task(self._serve(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await self._answer_one(reader, writer):
                pass
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError):
            pass  # the client went away, or took too long: nothing to tell it
        finally:
            self._forget(writer)
            writer.transport.abort()  # a reply that had to arrive was drained already

    def _forget(self, writer: asyncio.StreamWriter) -> asyncio.StreamWriter:
        self._connections.discard(writer)
        self._waiting.pop(writer, None)
        return writer

    async def _answer_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Reads one request and answers it; whether the connection stays open for another."""
        limits = self.limits
        self._waiting[writer] = None
        try:
            async with asyncio.timeout(limits.idle_timeout_s):
                first = await reader.read(1)  # the idle wait ends with a request's first byte
            if not first:
                return False
            async with asyncio.timeout(limits.head_timeout_s):
                head = first + await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            await self._write(writer, Reply(431, b"request head too large\n"), keep_alive=False)
            await _linger(reader, writer)
            return False
        finally:
            self._waiting.pop(writer, None)
        method = ""
        try:
            method, path, keep_alive = _parse(head)
            if method not in ("GET", "HEAD"):
                raise _Refused(Reply(405, f"method {method} not allowed: GET and HEAD are\n".encode()))
            reply = self._call(path)
        except _Refused as refused:
            reply, keep_alive = refused.reply, False
        await self._write(writer, reply, keep_alive, with_body=method != "HEAD")
        if not keep_alive:
            await _linger(reader, writer)
        return keep_alive

    def _call(self, path: str) -> Reply:
        try:
            return self.handler(path)
        except Exception:
            logger.exception("HTTP GET %r failed", path)
            return Reply(500, b"internal error\n")

    async def _write(self, writer: asyncio.StreamWriter, reply: Reply, keep_alive: bool,
                     with_body: bool = True) -> None:
        status = HTTPStatus(reply.status)
        head = [f"HTTP/1.1 {status.value} {status.phrase}", f"Content-Type: {reply.content_type}",
                f"Content-Length: {len(reply.body)}"]
        if status == HTTPStatus.METHOD_NOT_ALLOWED:
            head.append("Allow: GET, HEAD")
        if not keep_alive:
            head.append("Connection: close")
        writer.write("\r\n".join(head).encode("latin-1") + b"\r\n\r\n" + (reply.body if with_body else b""))
        async with asyncio.timeout(self.limits.write_timeout_s):
            await writer.drain()


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Ends the connection after its last reply: half-closes it, then drops what the client still
    sends (its request's body, pipelined requests) until it closes too, for at most LINGER_S. Closing
    a socket with data unread sends a reset, which can destroy the reply before the client reads it."""
    writer.write_eof()
    with contextlib.suppress(TimeoutError, ConnectionError):
        async with asyncio.timeout(LINGER_S):
            while await reader.read(65_536):
                pass


def _parse(head: bytes) -> tuple[str, str, bool]:
    """(method, path without its query, keep-alive) of a request head; raises _Refused (400, 505)."""
    lines = head.lstrip(b"\r\n").decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[0].isalpha() or not parts[1].startswith("/"):
        raise _Refused(Reply(400, b"bad request line\n"))
    method, target, version = parts
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise _Refused(Reply(505, b"HTTP/1.1 only\n"))
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if line and (not colon or not _TOKEN.fullmatch(name)):
            raise _Refused(Reply(400, b"bad header line\n"))
        if line:
            headers[name.lower()] = value.strip().lower()
    connection = {token.strip() for token in headers.get("connection", "").split(",")}
    keep_alive = version == "HTTP/1.1" and "close" not in connection  # HTTP/1.0: one request a connection
    if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
        keep_alive = False  # its body is never read: it must not be taken for the next request
    return method, target.split("?", 1)[0], keep_alive


def _bound_socket(address: str, port: int) -> socket.socket:
    """A listening socket on address:port (IPv6 when the address has a colon; `::` takes IPv4 too,
    as the kernel's default)."""
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT of a previous run is no conflict
        sock.bind((address, port))
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
