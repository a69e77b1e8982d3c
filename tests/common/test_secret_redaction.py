"""The redaction of known secrets on the log handler: a key or the worker secret never reaches a
line, wherever a record carries it (message, arguments, fields, forwarded JSON, traceback)."""
from __future__ import annotations

import logging

from common.security.api_keys import ApiKeys
from common.security.secret_redaction import REDACTED, SecretRedactionFilter
from common.security.worker_secret import new_secret
from launch.log_format import JsonFormatter, TextFormatter


def record(message: str, *args: object, **attributes: object) -> logging.LogRecord:
    made = logging.LogRecord("test", logging.INFO, __file__, 1, message, args or None, None)
    made.__dict__.update(attributes)
    return made


def test_known_secrets_are_redacted_wherever_a_record_carries_them() -> None:
    keys = ApiKeys(None, "first-key-0123456789, second-key-9876543210")
    secret = new_secret()
    try:
        raise ValueError(f"bad token second-key-9876543210 for {secret}")
    except ValueError as error:
        failed = record("call failed", exc_info=(ValueError, error, error.__traceback__))
    records = [record("id %s, then %s", "first-key-0123456789", secret),
               record("request finished", fields={"request_id": "x-second-key-9876543210-y", "n": 3}),
               record("", json_entry={"logger": "worker", "message": f"echo {secret}"}), failed]
    redaction = SecretRedactionFilter()
    assert all(redaction.filter(made) for made in records)
    lines = [TextFormatter().format(made) for made in records] + [JsonFormatter().format(made) for made in records]
    assert not [line for line in lines if "first-key" in line or "second-key" in line or secret in line]
    assert records[0].getMessage() == f"id {REDACTED}, then {REDACTED}"
    assert records[1].fields == {"request_id": f"x-{REDACTED}-y", "n": 3}
    assert records[2].json_entry == {"logger": "worker", "message": f"echo {REDACTED}"}
    assert f"bad token {REDACTED} for {REDACTED}" in lines[3]
    del keys  # a dropped ApiKeys is forgotten
    assert redaction.filter(made := record("first-key-0123456789")) and made.getMessage() == "first-key-0123456789"
