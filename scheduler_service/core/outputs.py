"""What the engine core reports: the one request output record (engine core to servicer) and its stats."""
from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_service.core.prompt_logprobs import TokenScore
from scheduler_service.core.sequence import FinishReason


@dataclass(slots=True)
class RequestOutput:
    """One delta of a request's output; the last one (finished) carries the final fields."""

    seq_id: int
    text: str = ""  # new text; never splits a character, never holds part of a possible stop string
    token_ids: list[int] = field(default_factory=list)  # the tokens that produced it (held-back ones too)
    logprobs: list[float] = field(default_factory=list)  # per token, when asked
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    queue_time_s: float | None = None  # on the last output, once the request was ever scheduled
    index: int = 0  # which of the request's n samples (AsyncEngine.generate tags them)
    # On the first output with tokens, when the request asked for prompt logprobs.
    prompt_logprobs: list[TokenScore] | None = None


def merged(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive deltas of one request joined into one, with the last one's final fields."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    return RequestOutput(
        seq_id=last.seq_id,
        text="".join(o.text for o in outputs),
        token_ids=[t for o in outputs for t in o.token_ids],
        logprobs=[p for o in outputs for p in o.logprobs],
        top_logprobs=[p for o in outputs for p in o.top_logprobs],
        finished=last.finished,
        finish_reason=last.finish_reason,
        matched_stop=last.matched_stop,
        num_prompt_tokens=last.num_prompt_tokens,
        num_output_tokens=last.num_output_tokens,
        num_cached_tokens=last.num_cached_tokens,
        queue_time_s=last.queue_time_s,
        index=last.index,
        prompt_logprobs=next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None),
    )


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of one engine core: its load, and counters summed over every worker it served."""

    is_attached: bool
    num_running: int
    num_waiting: int  # queued for admission; while detached, every unfinished request
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_preemptions: int = 0
    block_size: int = 0  # tokens per KV block; 0 while detached

    @property
    def kv_cache_usage(self) -> float:
        """Used blocks / total; 0 while detached."""
        return 1.0 - self.num_free_kv_blocks / self.num_kv_blocks if self.num_kv_blocks else 0.0
