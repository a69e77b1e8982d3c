"""Quoting client-supplied values in error messages, shortened.

Error details travel in a gRPC trailer: a message that echoes a whole 100 kB value exceeds the
16 KiB metadata limit, and the client then sees RESOURCE_EXHAUSTED "Stream removed" instead of
the real error. Every message that quotes input goes through quote().
"""
from __future__ import annotations

MAX_QUOTED_CHARS = 200


def quote(value: object, limit: int = MAX_QUOTED_CHARS) -> str:
    """repr(value), cut to about `limit` characters with the full length named when longer:
    'aaaa...' (100000 characters)."""
    if isinstance(value, str | bytes) and len(value) > limit:
        unit = "characters" if isinstance(value, str) else "bytes"
        return f"{value[:limit]!r}... ({len(value)} {unit})"
    text = repr(value)
    return text if len(text) <= limit + 2 else f"{text[:limit]}... ({len(text)} characters)"
