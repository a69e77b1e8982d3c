"""Sampling and stopping parameters of one request, validated once at the edge."""
from __future__ import annotations

import math
from dataclasses import dataclass

from common.generated.nanovllm.worker.v1 import worker_pb2
from common.quoting import quote

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_TOP_LOGPROBS = 20
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample and when to stop. Invalid values raise ValueError naming the field."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = -1  # -1 = all tokens
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_in_output: bool = False
    logprobs: bool = False
    num_top_logprobs: int = 0

    def __post_init__(self) -> None:
        # Accept lists for convenience; store tuples so the object stays hashable and frozen.
        object.__setattr__(self, "stop", _as_tuple(self.stop, "stop"))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids"))
        self._validate()

    def _validate(self) -> None:
        # NaN fails every comparison below but infinity passes some (temperature >= 0): refuse both.
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            _check(isinstance(value, int | float) and math.isfinite(value), name,
                   f"must be a finite number, got {quote(value)}")
        _check(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(self.top_k == -1 or self.top_k >= 1, "top_k", f"must be -1 (all) or >= 1, got {self.top_k}")
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(self.repetition_penalty > 0, "repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty}")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty}")
        _check(self.seed is None or 0 <= self.seed < 2**63, "seed", f"must be in [0, 2^63), got {self.seed}")
        _check(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop",
               f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for text in self.stop:
            _check(isinstance(text, str) and 0 < len(text) <= MAX_STOP_STRING_CHARS, "stop",
                   f"each stop string must have 1..{MAX_STOP_STRING_CHARS} characters, got {quote(text)}")
        for token_id in self.stop_token_ids:
            _check(isinstance(token_id, int) and token_id >= 0, "stop_token_ids", f"must be >= 0, got {token_id}")
        _check(0 <= self.num_top_logprobs <= MAX_TOP_LOGPROBS, "num_top_logprobs",
               f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.num_top_logprobs}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def to_proto(self) -> worker_pb2.SamplingParams:
        """The worker's view: only what sampling needs; neutral values are left unset."""
        msg = worker_pb2.SamplingParams(temperature=self.temperature)
        if self.top_k != -1:
            msg.top_k = self.top_k
        if self.top_p != 1.0:
            msg.top_p = self.top_p
        if self.min_p != 0.0:
            msg.min_p = self.min_p
        if self.repetition_penalty != 1.0:
            msg.repetition_penalty = self.repetition_penalty
        if self.frequency_penalty != 0.0:
            msg.frequency_penalty = self.frequency_penalty
        if self.presence_penalty != 0.0:
            msg.presence_penalty = self.presence_penalty
        if self.seed is not None:
            msg.seed = self.seed
        if self.logprobs:
            msg.return_logprobs = True
            msg.num_top_logprobs = self.num_top_logprobs
        return msg

    @property
    def needs_token_history(self) -> bool:
        """Penalties look at earlier tokens, so the worker needs each token on the host."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def _as_tuple(value: object, name: str) -> tuple:
    if isinstance(value, str):
        return (value,) if name == "stop" else _fail(name, "must be a list")
    try:
        return tuple(value)  # type: ignore[arg-type]
    except TypeError:
        _fail(name, f"must be a list, got {type(value).__name__}")
    return ()


def _check(condition: bool, name: str, message: str) -> None:
    if not condition:
        _fail(name, message)


def _fail(name: str, message: str) -> tuple:
    raise ValueError(f"{name}: {message}")
