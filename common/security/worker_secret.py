"""What both ends of the scheduler-worker link agree on: the shared secret and how it travels.

The secret comes from a file (--worker-secret-file) or the NANOVLLM_WORKER_SECRET environment
variable, never from a command-line value (those show in `ps`). It travels as
`authorization: Bearer <secret>` metadata on every worker call and is compared in constant time.
It is never logged: WorkerLinkConfig keeps it out of its repr.
"""
from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Iterable

from common.security.tls import read_file

SECRET_ENV = "NANOVLLM_WORKER_SECRET"
METADATA_KEY = "authorization"
MIN_SECRET_CHARS = 16


def load_secret(secret_file: str | None) -> str:
    """The secret from secret_file (surrounding whitespace dropped) or else from $NANOVLLM_WORKER_SECRET.
    Raises ValueError when neither holds one of at least MIN_SECRET_CHARS characters."""
    if secret_file:
        secret = read_file(secret_file, "worker_secret_file").decode().strip()
        source = f"worker_secret_file {secret_file!r}"
    else:
        secret = os.environ.get(SECRET_ENV, "").strip()
        source = f"${SECRET_ENV}"
        if not secret:
            raise ValueError(f"worker secret: none given; set {SECRET_ENV} or pass --worker-secret-file "
                             f"(e.g. `export {SECRET_ENV}=$(openssl rand -hex 32)`, the same for worker and scheduler)")
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"worker secret: {source} holds {len(secret)} characters, at least {MIN_SECRET_CHARS} "
                         f"are needed")
    return secret


def new_secret() -> str:
    """A random secret, for a worker this process starts itself."""
    return secrets.token_hex(32)


def secret_metadata(secret: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that authenticates a call to a worker."""
    return ((METADATA_KEY, f"Bearer {secret}"),)


def is_authorized(metadata: Iterable[tuple[str, str | bytes]] | None, secret: str) -> bool:
    """Whether the call's metadata carries the secret (constant-time comparison)."""
    expected = f"Bearer {secret}".encode()
    presented = b""
    for key, value in metadata or ():
        if key == METADATA_KEY:
            presented = value if isinstance(value, bytes) else value.encode()
    return hmac.compare_digest(presented, expected)
