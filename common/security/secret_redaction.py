"""The last guard before a log line is written: a secret the process knows never leaves it in a log.

No code of ours logs a key or the worker secret, and grpcio's records that quote client bytes are
filtered (common.security.grpc_logs); but a client may put a valid key anywhere it likes (a request
id, a method path, another header that some library logs), and the line that echoes it would hand
the key to whoever reads the log. So the holders of secrets register them here (ApiKeys its current
keys, the worker secret once loaded) and SecretRedactionFilter, on the process's log handler,
replaces each one in a record's message, fields and traceback by REDACTED.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

REDACTED = "<redacted>"
# Dict attributes of a record whose string values are written out: launch.log_format's structured
# fields, and the JSON object a record forwards from another process's log (launch.json_stderr).
DICT_ATTRIBUTES = ("fields", "json_entry")

_sources: list[Callable[[], Iterable[str | bytes]]] = []


def register_secret_source(source: Callable[[], Iterable[str | bytes]]) -> None:
    """Adds a function that returns secrets to redact (asked at each record: keys may rotate)."""
    _sources.append(source)


def known_secrets() -> list[str]:
    secrets = (secret.decode(errors="replace") if isinstance(secret, bytes) else secret
               for source in _sources for secret in source())
    return [secret for secret in secrets if secret]


def _redact(text: str, secrets: list[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, REDACTED)
    return text


class SecretRedactionFilter(logging.Filter):
    """Replaces every known secret in a record by REDACTED: its message (formatted here), the string
    values of its DICT_ATTRIBUTES and its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        secrets = known_secrets()
        if not secrets:
            return True
        try:
            message = record.getMessage()
        except (TypeError, ValueError):  # bad arguments: the handler reports it, without the arguments
            return True
        if any(secret in message for secret in secrets):
            record.msg, record.args = _redact(message, secrets), None
        for attribute in DICT_ATTRIBUTES:
            values = getattr(record, attribute, None)
            if isinstance(values, dict):
                setattr(record, attribute, {key: _redact(value, secrets) if isinstance(value, str) else value
                                            for key, value in values.items()})
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = _redact(record.exc_text, secrets)
        return True
