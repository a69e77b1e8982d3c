"""quote(): values in error messages, cut to about 200 characters with their full length named."""
from __future__ import annotations

from common.contract.quoting import quote


def test_short_values_are_quoted_whole() -> None:
    assert quote("bot") == "'bot'"
    assert quote(1.5) == "1.5"
    assert quote("x" * 200) == repr("x" * 200)


def test_long_values_are_cut_and_their_length_named() -> None:
    assert quote("x" * 100_000) == f"{'x' * 200!r}... (100000 characters)"
    assert quote(b"\xff" * 300, limit=2) == "b'\\xff\\xff'... (300 bytes)"
    assert quote(list(range(1000)), limit=10) == "[0, 1, 2, ... (4890 characters)"
