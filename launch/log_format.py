"""Log line formats of both services: text for people, JSON (one object per line) for log pipelines.

A record may carry structured fields (`logger.info("request finished", extra={"fields": {...}})`):
the text format appends them as key=value pairs, the JSON format as keys of the object, so that a
pipeline reads them without parsing the message.

Both formats keep client-chosen text on its line: the text format quotes such values, the JSON
format escapes U+0085 (and the other C1 controls), U+2028 and U+2029, which json.dumps leaves raw
and which some readers (JavaScript, Python's str.splitlines) take for line breaks. In the JSON
format every line of the process's stderr is a JSON object, gRPC core's own lines included
(launch.json_stderr). gRPC core's verbosity is ERROR unless GRPC_VERBOSITY says otherwise: at
its default it writes an INFO line for every failed TLS handshake, which anyone who can reach a
port could use to fill the log.
"""
from __future__ import annotations

import json
import logging
import os
import re
import sys
from datetime import UTC, datetime
from typing import Any, TextIO

from common.security.grpc_logs import GRPC_LOG_FILTER, install_grpc_log_filter
from common.security.secret_redaction import SecretRedactionFilter
from launch.json_stderr import JSON_ENTRY_ATTRIBUTE, capture_stderr

FIELDS_ATTRIBUTE = "fields"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Values printed bare in the text format; anything else is quoted (JSON string syntax), so that a
# client-chosen value (a request id) can neither break the line nor fake another field.
_BARE_VALUE = re.compile(r"[A-Za-z0-9_.:/+-]+")
# Left raw by json.dumps(ensure_ascii=False), read as line breaks by some readers.
_LINE_BREAKING = re.compile("[\u0080-\u009f\u2028\u2029]")
GRPC_VERBOSITY_ENV = "GRPC_VERBOSITY"
DEFAULT_GRPC_VERBOSITY = "ERROR"  # gRPC core's levels: DEBUG, INFO, ERROR, NONE


def json_line(entry: dict[str, Any]) -> str:
    """entry as one line of JSON: non-ASCII text kept readable, the characters some readers take for
    line breaks escaped."""
    text = json.dumps(entry, ensure_ascii=False, default=str)
    return _LINE_BREAKING.sub(lambda match: f"\\u{ord(match.group()):04x}", text)


def _text_value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6f}"
    text = str(value)
    return text if _BARE_VALUE.fullmatch(text) else json.dumps(text)


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    return getattr(record, FIELDS_ATTRIBUTE, None) or {}


class TextFormatter(logging.Formatter):
    """The usual text line, then the record's fields as key=value."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = fields_of(record)
        if not fields:
            return line
        return line + " " + " ".join(f"{key}={_text_value(value)}" for key, value in fields.items())


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, the record's fields,
    and the traceback as "exception" when there is one (or, as it is, the JSON object a record
    forwards from another process's log)."""

    def format(self, record: logging.LogRecord) -> str:
        forwarded = getattr(record, JSON_ENTRY_ATTRIBUTE, None)
        if forwarded is not None:
            return json_line(forwarded)
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(fields_of(record))
        if record.exc_info:  # the traceback made once per record (and redacted: common.security.secret_redaction)
            record.exc_text = record.exc_text or self.formatException(record.exc_info)
        if record.exc_text:
            entry["exception"] = record.exc_text
        return json_line(entry)


class LogHandler(logging.StreamHandler):
    """A StreamHandler that says nothing when its stream itself fails (a closed or broken stderr):
    logging's report of it would go to stderr, which in the JSON format is read back into this
    handler, round and round."""

    def handleError(self, record: logging.LogRecord) -> None:
        if isinstance(sys.exc_info()[1], OSError) or self.stream.closed:
            return
        super().handleError(record)


def configure_logging(level: str, log_format: str = "text") -> None:
    """Process start-up: sets the root logger's level and the format of its one stderr handler, gRPC
    core's verbosity (DEFAULT_GRPC_VERBOSITY unless GRPC_VERBOSITY is set; read when grpc is first
    imported, so call this before), the filter that keeps client-sent bytes out of grpcio's
    records and the one that redacts the secrets this process knows. In the JSON format, stderr
    itself is routed through logging (launch.json_stderr)."""
    os.environ.setdefault(GRPC_VERBOSITY_ENV, DEFAULT_GRPC_VERBOSITY)
    install_grpc_log_filter()
    stream: TextIO = sys.stderr
    if log_format == "json":
        stream = capture_stderr()
    handler = LogHandler(stream)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler.addFilter(GRPC_LOG_FILTER)  # grpcio's loggers made after install_grpc_log_filter, too
    handler.addFilter(SecretRedactionFilter())  # the keys and secrets this process knows, wherever they appear
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
