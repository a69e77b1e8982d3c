"""API keys on the public port: the keys common.security.bearer_auth's interceptor accepts there.

Keys come from a file (one per line; blank lines and lines starting with # are skipped), re-read
when it changes so that keys rotate without a restart, and from the NANOVLLM_API_KEYS environment
variable (comma-separated). Keys never appear on the command line (where `ps` shows them) nor in
any log line or error message.
"""
from __future__ import annotations

import logging
import os
import weakref

from common.security.bearer_auth import is_bearer_of
from common.security.reloading_files import ReloadingFiles
from common.security.secret_redaction import register_secret_source

logger = logging.getLogger(__name__)

API_KEYS_ENV = "NANOVLLM_API_KEYS"
API_KEY_REFUSAL = "authorization: send 'authorization: Bearer <API key>' with a valid key"


def count_keys(count: int) -> str:
    """'1 key', '2 keys' (and '0 keys')."""
    return f"{count} key" if count == 1 else f"{count} keys"


def _read_keys(path: str) -> list[bytes]:
    with open(path, encoding="utf-8") as file:
        lines = (line.strip() for line in file.read().splitlines())
    return [line.encode() for line in lines if line and not line.startswith("#")]


class ApiKeys:
    """The accepted keys: those of `path` (re-read when its modification time or size changes) and
    those of `env_value`. A file that becomes unreadable keeps the keys last read."""

    def __init__(self, path: str | None, env_value: str | None) -> None:
        self.path = path
        self._env_keys = [key.strip().encode() for key in (env_value or "").split(",") if key.strip()]
        self._file: ReloadingFiles[list[bytes]] | None = None
        self._unreadable: str | None = None  # why the file could not be read last time: warned once, not per call
        if path is not None:
            try:
                self._file = ReloadingFiles([path], lambda: _read_keys(path))
            except (OSError, UnicodeDecodeError) as error:
                raise ValueError(f"api_key_file: cannot read {path}: {error.__class__.__name__}") from error
        if not self.keys:
            raise ValueError("api_key_file: holds no key" if path else f"{API_KEYS_ENV}: holds no key")
        this = weakref.ref(self)  # the registry must not keep an ApiKeys alive
        register_secret_source(lambda: keys.keys if (keys := this()) is not None else ())

    @classmethod
    def from_config(cls, path: str | None, environ: dict[str, str] | os._Environ[str] = os.environ) -> ApiKeys | None:
        """The configured keys, or None when neither the file nor the environment variable is set."""
        env_value = environ.get(API_KEYS_ENV)
        if path is None and not env_value:
            return None
        return cls(path, env_value)

    @property
    def keys(self) -> list[bytes]:
        return (self._file.value if self._file is not None else []) + self._env_keys

    def _reload_if_changed(self) -> None:
        if self._file is None:
            return
        try:
            keys = self._file.reload_if_changed()
        except (OSError, UnicodeDecodeError) as error:
            reason = error.__class__.__name__
            if reason != self._unreadable:  # once while it stays so (calls would repeat it many times a second)
                logger.warning("API key file %s unreadable (%s): keeping the %s last read until it can be read "
                               "again", self.path, reason, count_keys(len(self.keys)))
                self._unreadable = reason
            return
        if self._unreadable is not None and keys is None:  # back as it was before it went missing
            logger.info("API key file %s readable again: %s", self.path, count_keys(len(self.keys)))
        self._unreadable = None
        if keys is not None:
            logger.info("API key file changed: %s", count_keys(len(keys)))

    def accepts(self, authorization: str | None) -> bool:
        """True when `authorization` is "Bearer <one of the keys>" (bearer_auth.is_bearer_of: constant time)."""
        self._reload_if_changed()
        return is_bearer_of(authorization, self.keys)
