"""API keys on the public port: `authorization: Bearer <key>` on every call but health checks.

Keys come from a file (one per line; blank lines and lines starting with # are skipped), re-read
when it changes so that keys rotate without a restart, and from the NANOVLLM_API_KEYS environment
variable (comma-separated). Keys never appear on the command line (where `ps` shows them) nor in
any log line or error message.
"""
from __future__ import annotations

import hmac
import logging
import os
from typing import Any

import grpc

from common.net.error_mapping import Continuation
from common.security.reloading_files import ReloadingFiles

logger = logging.getLogger(__name__)

API_KEYS_ENV = "NANOVLLM_API_KEYS"
# Load balancers probe health without credentials.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)


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
        if path is not None:
            try:
                self._file = ReloadingFiles([path], lambda: _read_keys(path))
            except (OSError, UnicodeDecodeError) as error:
                raise ValueError(f"api_key_file: cannot read {path}: {error.__class__.__name__}") from error
        if not self.keys:
            raise ValueError("api_key_file: holds no key" if path else f"{API_KEYS_ENV}: holds no key")

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
            logger.warning("API key file %s unreadable, keeping the keys last read (%s)", self.path,
                           error.__class__.__name__)
            return
        if keys is not None:
            logger.info("API key file changed: %d keys", len(keys))

    def accepts(self, authorization: str | None) -> bool:
        """True when `authorization` is "Bearer <one of the keys>". Compared in constant time against
        every key (no early exit), so timing says nothing about which key or how much matched."""
        self._reload_if_changed()
        scheme, _, token = (authorization or "").partition(" ")
        presented = token.strip().encode()
        matched = False
        for key in self.keys:
            matched |= hmac.compare_digest(presented, key)
        return matched and scheme.lower() == "bearer"


def _authorization(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode(errors="replace")
    return None


async def _refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        "authorization: send 'authorization: Bearer <API key>' with a valid key")


def _refusing_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call with UNAUTHENTICATED."""
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(_refuse)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(_refuse)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(_refuse)
    return grpc.stream_stream_rpc_method_handler(_refuse)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without a valid key (UNAUTHENTICATED) except health checks. The refusing
    handler has no request deserializer: a refused call's body is never parsed."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(self, continuation: Continuation,
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        if self.keys.accepts(_authorization(handler_call_details.invocation_metadata)):
            return handler
        logger.debug("%s: UNAUTHENTICATED", handler_call_details.method)  # never the key itself
        return _refusing_handler(handler)
