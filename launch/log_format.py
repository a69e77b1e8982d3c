"""Log line formats of both services: text for people, JSON (one object per line) for log pipelines.

A record may carry structured fields (`logger.info("request finished", extra={"fields": {...}})`):
the text format appends them as key=value pairs, the JSON format as keys of the object, so that a
pipeline reads them without parsing the message.
"""
from __future__ import annotations

import json
import logging
import re
from datetime import UTC, datetime
from typing import Any

FIELDS_ATTRIBUTE = "fields"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Values printed bare in the text format; anything else is quoted (JSON string syntax), so that a
# client-chosen value (a request id) can neither break the line nor fake another field.
_BARE_VALUE = re.compile(r"[A-Za-z0-9_.:/+-]+")


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
    and the traceback as "exception" when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(fields_of(record))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(level: str, log_format: str = "text") -> None:
    """Sets the root logger's level and the format of its one stderr handler."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
