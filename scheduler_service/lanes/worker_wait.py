"""Waiting for a worker to answer: retries a call until it does, logging each new reason once, in
words an operator can act on (a TLS or address mistake reads as more than UNAVAILABLE)."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

logger = logging.getLogger(__name__)
RETRY_S = 1.0  # between attempts
_Result = TypeVar("_Result")

# What gRPC's connection errors mean for a worker link, by a phrase of their details: (phrase, when
# the link uses TLS (None: either way), the explanation).
_DIAGNOSES: tuple[tuple[str, bool | None, str], ...] = (
    ("CERTIFICATE_VERIFY_FAILED", None, "the worker's certificate does not verify against --worker-tls-ca (signed "
                                        "by another CA, or not issued for this address)"),
    ("WRONG_VERSION_NUMBER", None, "the worker does not speak TLS: it listens in plaintext"),
    ("Socket closed", False, "the worker closed the connection: it may expect TLS (give --worker-tls-ca)"),
    ("Socket closed", True, "the worker closed the TLS handshake: it may require a client certificate "
                            "(--worker-tls-cert and --worker-tls-key) or not trust ours"),
    ("Connection refused", None, "nothing listens there (yet)"),
)


def diagnose(error: grpc.aio.AioRpcError, uses_tls: bool) -> str:
    """The code and, where the details tell it, why the link failed."""
    details = error.details() or ""
    for phrase, tls, explanation in _DIAGNOSES:
        if phrase in details and tls in (None, uses_tls):
            return f"{error.code().name}: {explanation}"
    if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return error.code().name
    return f"{error.code().name}: {details}"


async def until_answered(address: str, uses_tls: bool, call: Callable[[], Awaitable[_Result]]) -> _Result:
    """call()'s result, calling it again every RETRY_S while it raises a gRPC error. The wait is
    logged when it starts and when its reason changes, not at each retry: INFO while the worker is
    unreachable, ERROR when it refuses us (a wrong secret, a claim held by another session)."""
    last_reason = None
    while True:
        try:
            return await call()
        except grpc.aio.AioRpcError as error:
            reason = diagnose(error, uses_tls)
            if reason != last_reason:
                if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    logger.info("waiting for worker %s: %s", address, reason)
                else:
                    logger.error("worker %s refused us: %s; retrying", address, reason)
                last_reason = reason
        await asyncio.sleep(RETRY_S)
