"""What both ends of the scheduler-worker link agree on: the shared secret and how it travels.

The secret comes from a file (--worker-secret-file) or the NANOVLLM_WORKER_SECRET environment
variable, never from a command-line value (those show in `ps`). It travels as
`authorization: Bearer <secret>` metadata on every worker call and is compared in constant time
(common.security.bearer_auth's interceptor, with accepts_secret). It is never logged:
WorkerLinkConfig keeps it out of its repr, and a loaded secret is redacted from every log line
(common.security.secret_redaction), should a client echo it.
"""
from __future__ import annotations

import functools
import os
import secrets
from collections.abc import Callable

from common.security.bearer_auth import METADATA_KEY, is_bearer_of
from common.security.secret_redaction import register_secret_source
from common.security.tls import read_file

SECRET_ENV = "NANOVLLM_WORKER_SECRET"
MIN_SECRET_CHARS = 16
SECRET_REFUSAL = "worker: missing or wrong secret"


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
    register_secret_source(lambda: (secret,))  # redacted from this process's log
    return secret


def new_secret() -> str:
    """A random secret, for a worker this process starts itself."""
    secret = secrets.token_hex(32)
    register_secret_source(lambda: (secret,))  # redacted from this process's log
    return secret


def secret_metadata(secret: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that authenticates a call to a worker."""
    return ((METADATA_KEY, f"Bearer {secret}"),)


def accepts_secret(secret: str) -> Callable[[str | None], bool]:
    """Whether a call's `authorization` value is "Bearer <secret>" (constant-time comparison)."""
    return functools.partial(is_bearer_of, keys=(secret.encode(),))
