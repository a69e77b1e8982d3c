"""Sampling and stopping parameters of one request: declared once, validated once at the edge.

Each SamplingParams field is one row of the table `PARAMS`: its default, its validator, the
GenerateRequest field and the worker's SamplingParams field it travels in (the same name unless
said). Validation, the public request conversion, the Step message conversion both ways and the
client's keyword arguments all read that table. A new parameter is one field here, its fields in
the two .proto files, and its use on the worker (worker_service/sampling/sampling_state.py lays it
out for the batch, worker_service/sampling/sampler.py applies it).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

from google.protobuf.message import Message

from common.contract.constraint import Constraint
from common.contract.quoting import quote
from common.generated.nanovllm.worker.v1 import worker_pb2

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_TOP_LOGPROBS = 20
MAX_N = 32
MAX_LOGIT_BIAS = 1024
MAX_ABS_LOGIT_BIAS = 100.0
MAX_SEED = 2**63
# Temperatures below this sample as greedy: dividing by them can overflow float32 to inf and NaN.
MIN_TEMPERATURE = 1e-5

Validator = Callable[[Any], str | None]  # the problem with a value, None when it is valid


def _must(test: Callable[[Any], bool], limit: str) -> Validator:
    def problem(value: Any) -> str | None:
        try:
            valid = test(value)
        except TypeError:  # a value of the wrong type (None, a string) is invalid, not a crash
            valid = False
        return None if valid else f"must be {limit}, got {quote(value)}"
    return problem


def _stop_problem(stop: tuple) -> str | None:
    if len(stop) > MAX_STOP_STRINGS:
        return f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}"
    for text in stop:
        if not (isinstance(text, str) and 0 < len(text) <= MAX_STOP_STRING_CHARS):
            return f"each stop string must have 1..{MAX_STOP_STRING_CHARS} characters, got {quote(text)}"
    return None


def _logit_bias_problem(bias: tuple) -> str | None:
    if len(bias) > MAX_LOGIT_BIAS:
        return f"at most {MAX_LOGIT_BIAS} entries, got {len(bias)}"
    for entry in bias:
        token_id, value = entry if isinstance(entry, tuple) and len(entry) == 2 else (None, None)
        if not isinstance(token_id, int) or token_id < 0:
            return f"token ids must be >= 0, got {quote(token_id)}"
        if not isinstance(value, int | float) or not abs(value) <= MAX_ABS_LOGIT_BIAS:
            limit = f"[-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}]"
            return f"biases must be in {limit}, got {quote(value)} for token {token_id}"
    return None


def _param(default: Any, validator: Validator | None = None, *, public: str = "", worker: str | bool = True,
           history: bool = False) -> Any:
    """A SamplingParams field and its row of the table. `public` / `worker`: the proto field names
    when they differ from the field's (worker=False: the worker never needs it); `history`: a value
    other than the default needs the sequence's earlier tokens on the worker."""
    return field(default=default, metadata={"validator": validator, "public": public, "worker": worker,
                                            "history": history})


@dataclass(frozen=True)
class SamplingParams:
    """How to sample and when to stop. Invalid values raise ValueError naming the field."""

    temperature: float = _param(1.0, _must(lambda v: v >= 0, ">= 0"))  # 0 = greedy
    top_k: int = _param(-1, _must(lambda v: v == -1 or v >= 1, "-1 (all) or >= 1"))
    top_p: float = _param(1.0, _must(lambda v: 0 < v <= 1, "in (0, 1]"))
    min_p: float = _param(0.0, _must(lambda v: 0 <= v <= 1, "in [0, 1]"))
    # HF semantics, over prompt and output tokens.
    repetition_penalty: float = _param(1.0, _must(lambda v: v > 0, "> 0"), history=True)
    # OpenAI semantics, over output tokens.
    frequency_penalty: float = _param(0.0, _must(lambda v: -2 <= v <= 2, "in [-2, 2]"), history=True)
    presence_penalty: float = _param(0.0, _must(lambda v: -2 <= v <= 2, "in [-2, 2]"), history=True)
    seed: int | None = _param(None, _must(lambda v: v is None or 0 <= v < MAX_SEED, "in [0, 2^63)"))
    max_tokens: int = _param(16, _must(lambda v: v >= 1, ">= 1"), worker=False)
    stop: tuple[str, ...] = _param((), _stop_problem, worker=False)
    stop_token_ids: tuple[int, ...] = _param(
        (), _must(lambda v: all(isinstance(t, int) and t >= 0 for t in v), "token ids >= 0"), worker=False)
    ignore_eos: bool = _param(False, worker=False)
    include_stop_in_output: bool = _param(False, worker=False)
    logprobs: bool = _param(False, worker="return_logprobs")
    num_top_logprobs: int = _param(0, _must(lambda v: 0 <= v <= MAX_TOP_LOGPROBS, f"in [0, {MAX_TOP_LOGPROBS}]"),
                                   public="top_logprobs")
    # token id -> bias, sorted by id (a tuple of pairs: the object stays hashable).
    logit_bias: tuple[tuple[int, float], ...] = _param((), _logit_bias_problem)
    # Until this many output tokens, EOS and stop tokens may not be sampled (the scheduler sends which).
    min_tokens: int = _param(0, _must(lambda v: v >= 0, ">= 0"))
    # None: no prompt logprobs; else the alternatives per prompt token.
    num_prompt_logprobs: int | None = _param(
        None, _must(lambda v: v is None or 0 <= v <= MAX_TOP_LOGPROBS, f"in [0, {MAX_TOP_LOGPROBS}]"),
        public="prompt_logprobs")
    n: int = _param(1, _must(lambda v: 1 <= v <= MAX_N, f"in [1, {MAX_N}]"), worker=False)
    constraint: Constraint | None = _param(None, worker=False)

    def __post_init__(self) -> None:
        for param in PARAMS:
            value = getattr(self, param.name)
            if isinstance(param.default, tuple):
                # Accept lists for convenience; store tuples so the object stays hashable and frozen.
                value = _as_tuple(value, param.name)
                object.__setattr__(self, param.name, value)
            # NaN fails every range test but infinity passes some (temperature >= 0): refuse both.
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{param.name}: must be a finite number, got {quote(value)}")
            problem = param.validator(value) if param.validator else None
            if problem:
                raise ValueError(f"{param.name}: {problem}")
        # As OpenAI's API: alternatives are asked for on top of the sampled token's logprob, not instead.
        if self.num_top_logprobs and not self.logprobs:
            raise ValueError(f"num_top_logprobs: needs logprobs: true (got {self.num_top_logprobs} "
                             "with logprobs: false)")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise ValueError(f"constraint: must be a Constraint, got {type(self.constraint).__name__}")
        object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias)))

    # Cached: the worker reads these several times per row at every step.
    @cached_property
    def is_greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @cached_property
    def needs_token_history(self) -> bool:
        """Penalties look at earlier tokens, so the worker needs each token on the host."""
        return any(getattr(self, p.name) != p.default for p in PARAMS if p.history)

    def to_proto(self) -> worker_pb2.SamplingParams:
        """The worker's view: only what sampling needs; neutral values are left unset (the scheduler
        adds min_tokens_banned_ids, which depend on its EOS ids)."""
        values = {p.worker: getattr(self, p.name) for p in WORKER_PARAMS if getattr(self, p.name) != p.default}
        if self.logit_bias:
            values["logit_bias"] = dict(self.logit_bias)
        return worker_pb2.SamplingParams(**values)

    @classmethod
    def from_proto(cls, message: worker_pb2.SamplingParams) -> SamplingParams:
        """The inverse of to_proto: unset fields take the defaults, but max_tokens (which never
        travels: the worker does not stop sequences) covers min_tokens."""
        values = values_of(message, WORKER_PARAMS, lambda p: p.worker)
        if values.get("min_tokens", 0) > cls.max_tokens:
            values["max_tokens"] = values["min_tokens"]
        return cls(**values)


@dataclass(frozen=True)
class Param:
    """One row of the table: a SamplingParams field and the proto fields it travels in."""

    name: str
    default: Any
    validator: Validator | None
    public: str  # the GenerateRequest field
    worker: str  # the worker_pb2.SamplingParams field; "" when the worker does not need it
    history: bool


PARAMS: tuple[Param, ...] = tuple(
    Param(f.name, f.default, f.metadata["validator"], f.metadata["public"] or f.name,
          f.name if f.metadata["worker"] is True else f.metadata["worker"] or "", f.metadata["history"])
    for f in fields(SamplingParams))
WORKER_PARAMS: tuple[Param, ...] = tuple(p for p in PARAMS if p.worker)


def values_of(message: Message, params: tuple[Param, ...], name_of: Callable[[Param], str]) -> dict[str, Any]:
    """The parameters a protobuf message sets, by SamplingParams field name: fields with presence
    when set, other fields (repeated, plain bool) always; repeated fields as tuples, maps as tuples
    of (key, value) pairs. Message fields (the constraint) are left to their own conversion."""
    values: dict[str, Any] = {}
    for param in params:
        name = name_of(param)
        descriptor = message.DESCRIPTOR.fields_by_name.get(name)
        if descriptor is None or (descriptor.message_type is not None and not _is_map(descriptor)):
            continue
        if descriptor.has_presence and not message.HasField(name):
            continue
        value = getattr(message, name)
        if _is_map(descriptor):
            values[param.name] = tuple(sorted(value.items()))
        else:
            values[param.name] = value if isinstance(value, bool | int | float | str) else tuple(value)
    return values


def _is_map(descriptor: Any) -> bool:
    message_type = descriptor.message_type
    return message_type is not None and message_type.GetOptions().map_entry


def _as_tuple(value: object, name: str) -> tuple:
    if isinstance(value, str):
        if name == "stop":
            return (value,)
        raise ValueError(f"{name}: must be a list")
    try:
        return tuple(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name}: must be a list, got {type(value).__name__}") from None
