"""Each Step's deadline, scaled from the time steps took lately rather than fixed.

It catches a worker whose process answers heartbeats but whose model work hangs, so it is generous:
the base (--step-timeout) plus DEADLINE_FACTOR times what the step's tokens (and those of the step
ahead of it, which the worker finishes first) would take at the slowest per-token rate measured
lately. A step's per-token rate is highest for small decode steps (their fixed costs are spread over
few tokens), so a large prefill gets more than it needs. The slowest rate fades by DECAY per step, so
one slow step (a compile, a burst of contention) does not widen the deadlines for good.
"""
from __future__ import annotations

DEADLINE_FACTOR = 10.0
DECAY = 0.95


class StepDeadlines:
    def __init__(self, base_s: float, initial_per_token_s: float) -> None:
        self.base_s = base_s
        self.per_token_s = initial_per_token_s  # the slowest rate measured lately; the flag's until one is
        self._measured = False

    def timeout_s(self, num_tokens: int) -> float:
        return self.base_s + DEADLINE_FACTOR * self.per_token_s * max(num_tokens, 1)

    def observe(self, num_tokens: int, duration_s: float) -> None:
        """A step of num_tokens (with those of the step ahead of it) returned duration_s after it was sent."""
        rate = duration_s / max(num_tokens, 1)
        self.per_token_s = max(rate, self.per_token_s * DECAY) if self._measured else rate
        self._measured = True
