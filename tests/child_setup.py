"""Set-up a test's child process needs before it runs its command, done by a fresh interpreter that
then execs the command (same pid; its program looked up on PATH as a shell would), never by
`subprocess`'s preexec_fn.

preexec_fn makes Python fork() rather than vfork()/posix_spawn(): the child then runs the fork
handlers of every library loaded in the test process, and gRPC's (grpcio >= 1.81, grpc/grpc#43055)
restarts its poller thread in the child, whose epoll file is closed before exec; the child can die
before exec without a word, and the test sees a port that never answers. The interpreter started
here has loaded no gRPC."""
from __future__ import annotations

import sys
from collections.abc import Sequence

_SET_UP_THEN_EXEC = "import os, sys\n{set_up}\nos.execvp(sys.argv[1], sys.argv[1:])"


def _prefixed(set_up: str, command: Sequence[str]) -> list[str]:
    return [sys.executable, "-c", _SET_UP_THEN_EXEC.format(set_up=set_up), *command]


def with_open_file_limit(command: Sequence[str], soft: int, hard: int | None = None) -> list[str]:
    """command, started with this soft open-file limit (at most the hard one) and this hard one
    (None: the hard limit it inherits). Lowering either needs no privilege."""
    set_up = ("import resource\n"
              f"hard = {'resource.getrlimit(resource.RLIMIT_NOFILE)[1]' if hard is None else hard}\n"
              f"soft = {soft} if hard == resource.RLIM_INFINITY else min({soft}, hard)\n"
              "resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))")
    return _prefixed(set_up, command)


def with_controlling_terminal(command: Sequence[str]) -> list[str]:
    """command, with its stdin (a terminal) as its controlling terminal: for a child that Popen
    started in its own session (start_new_session=True)."""
    return _prefixed("import fcntl, termios\nfcntl.ioctl(0, termios.TIOCSCTTY, 0)", command)
