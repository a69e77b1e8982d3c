"""Idle TCP connections opened in bulk against a port, what a test reads of them (which the server has
closed), and what it reads of the process serving them (threads and open files, from /proc)."""
from __future__ import annotations

import resource
import select
import socket
from pathlib import Path

import pytest

from common.net.open_files import raise_open_file_limit


def num_threads(pid: int | str = "self") -> int:
    """The process's threads as the kernel counts them (Python's and native ones alike)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError(f"no Threads line in /proc/{pid}/status")


def num_open_files(pid: int | str = "self") -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def need_open_files(count: int) -> None:
    """Raises this process's soft open-file limit to its hard one; skips when even that is below count."""
    raise_open_file_limit()
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < count:
        pytest.skip(f"needs {count} open files; this machine allows {soft}")


class IdleConnections:
    """`count` TCP connections to host:port that never send a byte (closed on exit)."""

    def __init__(self, port: int, count: int, host: str = "127.0.0.1") -> None:
        self.sockets: list[socket.socket] = []
        self.closed: set[int] = set()  # indexes of those the server closed
        self.answered: set[int] = set()  # indexes of those the server sent bytes (gRPC's SETTINGS)
        try:
            for _ in range(count):
                sock = socket.create_connection((host, port), timeout=30)
                sock.setblocking(False)
                self.sockets.append(sock)
        except BaseException:
            self.close()
            raise

    def poll(self) -> None:
        """Reads (and drops) what the server sent; notes the connections it closed."""
        poller = select.poll()
        by_fd = {}
        for index, sock in enumerate(self.sockets):
            if index not in self.closed:
                poller.register(sock, select.POLLIN)
                by_fd[sock.fileno()] = index
        for fd, _ in poller.poll(0):
            index = by_fd[fd]
            try:
                while self.sockets[index].recv(65_536):
                    self.answered.add(index)
                self.closed.add(index)
            except BlockingIOError:
                pass
            except ConnectionError:
                self.closed.add(index)

    def num_closed(self) -> int:
        self.poll()
        return len(self.closed)

    def num_answered(self) -> int:
        self.poll()
        return len(self.answered)

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()

    def __enter__(self) -> IdleConnections:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
