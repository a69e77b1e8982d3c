"""In the JSON log format, every line the process writes to stderr is a JSON object.

Python's logging writes JSON, but native code writes to file descriptor 2 itself: gRPC core
(`E1201 12:00:00.123456  1234 ssl_transport_security.cc:2563] Handshake failed ...`), absl, torch,
CUDA; so do print(..., file=sys.stderr), uncaught exceptions and child processes that share our
stderr. capture_stderr(), once, at start-up:

- dups fd 2 (the real stderr) and returns a line-buffered stream on it, for the log handler;
- puts a pipe on fd 2, read by a daemon thread that logs each line: gRPC core's under logger
  "grpc.core" at its first letter's level (I, W, E, F) with its source file and line as the field
  `source`; a line that already is a JSON object (the worker's log, which `nanovllm serve` forwards)
  as it is, re-escaped; any other line under logger "stderr" at WARNING;
- logs an uncaught exception (of any thread) as one record, its traceback in "exception";
- points faulthandler at the real stderr: after a crash no thread is left to read the pipe.

At exit, an atexit function puts the real stderr back on fd 2 and logs what the pipe still holds
(waiting up to DRAIN_S). What is not JSON or is lost: lines written after that, during interpreter
teardown, go out raw; faulthandler's crash report is plain text; on SIGKILL or os._exit the lines
still in the pipe (the reader keeps up: at most the last few) are lost.
"""
from __future__ import annotations

import atexit
import faulthandler
import functools
import json
import logging
import os
import re
import sys
import threading
from types import TracebackType
from typing import Any, TextIO

CORE_LOGGER = "grpc.core"
STDERR_LOGGER = "stderr"
MAX_LINE_BYTES = 64 * 1024  # a longer line is logged in pieces of this size
DRAIN_S = 2.0
# absl's prefix: level letter, MMDD, time, thread id, file:line] (gRPC core logs through absl).
_CORE_LINE = re.compile(r"([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ ([^\]\s]+)\] ?(.*)", re.DOTALL)
_CORE_LEVELS = {"I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}
# A record that carries a whole JSON object (another process's line): launch.log_format writes it as is.
JSON_ENTRY_ATTRIBUTE = "json_entry"

_capture: StderrCapture | None = None


def _json_object(text: str) -> dict[str, Any] | None:
    if not text.startswith("{"):
        return None
    try:
        entry = json.loads(text)
    except ValueError:
        return None
    return entry if isinstance(entry, dict) else None


def log_stderr_line(text: str) -> None:
    """Logs one line read from stderr (its line break removed), as the module docstring says."""
    if not text.strip():
        return
    core = _CORE_LINE.fullmatch(text)
    if core is not None:
        level, source, message = _CORE_LEVELS[core[1]], core[2], core[3]
        logger = logging.getLogger(CORE_LOGGER)
        if logger.isEnabledFor(level):
            logger.log(level, "%s", message, extra={"fields": {"source": source}})
        return
    logger = logging.getLogger(STDERR_LOGGER)
    entry = _json_object(text)
    if entry is None:
        logger.warning("%s", text)
        return
    record = logger.makeRecord(STDERR_LOGGER, logging.INFO, "", 0, "", None, None)
    setattr(record, JSON_ENTRY_ATTRIBUTE, entry)  # its own process chose to write it
    logger.handle(record)


def _log_uncaught(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    logging.getLogger("nanovllm").critical("uncaught exception", exc_info=(exc_type, exc, tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:  # as threading's own hook: silent
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("nanovllm").critical("uncaught exception in thread %s", name,
                                           exc_info=(args.exc_type, args.exc_value, args.exc_traceback))


class StderrCapture:
    """fd 2 on a pipe read back into logging; `real` writes to the stderr the process started with."""

    def __init__(self) -> None:
        self.real_fd = os.dup(2)
        self.real: TextIO = open(self.real_fd, "w", buffering=1, encoding="utf-8",  # noqa: SIM115
                                 errors="backslashreplace", closefd=False)
        sys.stderr.flush()
        read_fd, write_fd = os.pipe()
        os.dup2(write_fd, 2)  # fd 2 alone holds the pipe's write end now: EOF once it is put back
        os.close(write_fd)
        self._pipe = open(read_fd, "rb")  # noqa: SIM115
        self._thread = threading.Thread(target=self._forward, name="stderr-to-log", daemon=True)
        self._thread.start()
        faulthandler.enable(self.real_fd, all_threads=True)
        sys.excepthook = _log_uncaught
        threading.excepthook = _log_uncaught_in_thread
        atexit.register(self.close)

    def _forward(self) -> None:
        with self._pipe:
            for raw in iter(functools.partial(self._pipe.readline, MAX_LINE_BYTES), b""):
                log_stderr_line(raw.decode("utf-8", "replace").rstrip("\r\n"))

    def close(self) -> None:
        """Puts the real stderr back on fd 2 and logs what is left in the pipe."""
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(self.real_fd, 2)
        self._thread.join(DRAIN_S)  # a child process that shares the pipe may keep it open: no longer


def capture_stderr() -> TextIO:
    """Routes fd 2 through logging (once per process) and returns the stream on the real stderr."""
    global _capture
    if _capture is None:
        _capture = StderrCapture()
    return _capture.real
