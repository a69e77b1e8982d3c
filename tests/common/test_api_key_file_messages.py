"""The API key file's log lines: a missing file is warned about once while it stays missing (not on
every call), and counts read "1 key", "2 keys"."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from common.security.api_keys import ApiKeys, count_keys

LOGGER = "common.security.api_keys"


def test_count_keys() -> None:
    assert [count_keys(n) for n in (0, 1, 2)] == ["0 keys", "1 key", "2 keys"]


def _lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == LOGGER]
    caplog.clear()
    return lines


def test_a_missing_key_file_is_warned_about_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    path = tmp_path / "keys.txt"
    path.write_text("key-1\n")
    keys = ApiKeys(str(path), None)
    path.unlink()
    assert [keys.accepts("Bearer key-1") for _ in range(3)] == [True] * 3  # the keys last read stay
    assert _lines(caplog) == [("WARNING", f"API key file {path} unreadable (FileNotFoundError): keeping the 1 key "
                                          "last read until it can be read again")]
    path.write_text("key-1\nkey-2\n")
    assert keys.accepts("Bearer key-2") and keys.accepts("Bearer key-1")
    assert _lines(caplog) == [("INFO", "API key file changed: 2 keys")]
    path.unlink()
    assert not keys.accepts("Bearer key-3")
    assert _lines(caplog) == [("WARNING", f"API key file {path} unreadable (FileNotFoundError): keeping the 2 keys "
                                          "last read until it can be read again")]  # warned again: it went again


def test_a_changed_key_file_logs_its_count(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    path = tmp_path / "keys.txt"
    path.write_text("key-1\nkey-2\n")
    keys = ApiKeys(str(path), None)
    path.write_text("key-3\n")
    os.utime(path, ns=(1, 1))  # a change even within the file system's time resolution
    assert keys.accepts("Bearer key-3") and not keys.accepts("Bearer key-1")
    assert _lines(caplog) == [("INFO", "API key file changed: 1 key")]
