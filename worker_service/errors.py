"""Errors the worker raises; worker_service/interceptors.py maps each to one status code."""
from __future__ import annotations


class SessionLostError(RuntimeError):
    """The call's session does not hold the worker: taken over, or never claimed on this worker
    process (it restarted). The caller's state here is gone (ABORTED)."""


class ClaimRefusedError(RuntimeError):
    """Another session holds the worker and the claim did not ask to take over (FAILED_PRECONDITION)."""


class StepOrderError(ValueError):
    """A step id out of order: already used by this session, or skipping one (FAILED_PRECONDITION)."""
