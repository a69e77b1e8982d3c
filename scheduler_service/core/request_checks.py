"""What the engine core checks of every request before queuing it, whichever API it came through:
each refusal a RequestError (INVALID_ARGUMENT) naming the field and the limit."""
from __future__ import annotations

from collections.abc import Iterable

from common.contract.sampling_params import SamplingParams
from scheduler_service.core.errors import RequestError


def check_prompt(prompt_token_ids: list[int], max_model_len: int, vocab_size: int) -> None:
    """A prompt that can never be served. max_model_len is capped at the KV cache's capacity, so a
    prompt within it also fits in the cache."""
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        raise RequestError("prompt: must not be empty")
    if num_prompt >= max_model_len:
        raise RequestError(f"prompt: {num_prompt} tokens, the limit is {max_model_len - 1} "
                           f"(max_model_len {max_model_len} minus one generated token)")
    _check_vocabulary("prompt_token_ids", prompt_token_ids, vocab_size)


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Token ids of the parameters outside the vocabulary."""
    _check_vocabulary("logit_bias", (token_id for token_id, _ in params.logit_bias), vocab_size)
    _check_vocabulary("stop_token_ids", params.stop_token_ids, vocab_size)


def _check_vocabulary(field: str, token_ids: Iterable[int], vocab_size: int) -> None:
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"{field}: token id {bad} is outside the vocabulary [0, {vocab_size})")
