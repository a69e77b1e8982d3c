"""When a sequence stops: the first of its new tokens that ends it (EOS, a stop token, a stop string,
max_tokens or the context), read by the engine core as each step's tokens arrive."""
from __future__ import annotations

from scheduler_service.core.sequence import FinishReason, Sequence


def first_stop(seq: Sequence, token_ids: list[int], eos_token_ids: frozenset[int],
               max_model_len: int) -> tuple[FinishReason | None, str | int | None, int]:
    """The first of seq's new tokens that ends it: (why, the stop it matched, how many tokens are
    kept). Each kept token's text is added on the way, so that a completed stop string ends seq
    at once and no later token follows it."""
    params = seq.sampling_params
    stop_token_ids = params.stop_token_ids
    eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
    # LENGTH once the output reaches max_tokens or the sequence max_model_len (a sequence
    # already there ends with its first new token).
    num_left = max(min(seq.num_prompt_tokens + params.max_tokens, max_model_len) - seq.num_tokens, 1)
    detokenizer = seq.detokenizer
    if detokenizer is None and not stop_token_ids and not eos_token_ids:
        if num_left <= len(token_ids):
            return FinishReason.LENGTH, None, num_left
        return None, None, len(token_ids)
    stop_adds_text = params.include_stop_in_output  # else the EOS or stop token adds no text
    for index, token_id in enumerate(token_ids):
        reason, matched_stop = None, None
        if token_id in stop_token_ids:
            reason, matched_stop = FinishReason.STOP, token_id
        elif token_id in eos_token_ids:
            reason = FinishReason.STOP
        elif index + 1 >= num_left:
            reason = FinishReason.LENGTH
        if detokenizer is not None and (reason is not FinishReason.STOP or stop_adds_text):
            if detokenizer.add_token(token_id) is not None and reason is not FinishReason.STOP:
                reason, matched_stop = FinishReason.STOP_SEQUENCE, detokenizer.matched_stop
        if reason is not None:
            return reason, matched_stop, index + 1
    return None, None, len(token_ids)
