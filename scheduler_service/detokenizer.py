"""Incremental detokenization with stop strings.

Each new token decodes in O(1) against a short window of earlier tokens, so that the text of a
token whose meaning depends on its neighbours (a leading space, a multi-byte character split over
tokens) comes out right. A delta never ends inside a UTF-8 character, and text that could be the
start of a stop string is held back until it is decided; the tail is flushed when the sequence ends.
"""
from __future__ import annotations

from typing import Protocol

# Tokens of the prompt kept as context for decoding the first output tokens.
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class TokenDecoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: TokenDecoder, prompt_token_ids: list[int], stop: tuple[str, ...] = (),
                 include_stop_in_output: bool = False) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop_in_output = include_stop_in_output
        self.token_ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""  # the output text decided so far (after a stop string matched: truncated)
        self.num_emitted_chars = 0
        self.matched_stop: str | None = None

    def add_token(self, token_id: int) -> str | None:
        """Decodes one more output token; returns the stop string it completed, if any."""
        self.token_ids.append(token_id)
        old_len = len(self.text)
        self._decode_pending(final=False)
        return self._find_stop(old_len)

    def finish(self) -> None:
        """Flushes text held back for an incomplete character (the sequence ended)."""
        if self.matched_stop is None:
            self._decode_pending(final=True)

    def take_delta(self, finished: bool) -> str:
        """The new text since the last call; while unfinished, a possible stop-string start is
        held back."""
        end = len(self.text)
        if not finished and self.matched_stop is None:
            end -= self._stop_prefix_len()
        delta = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = max(self.num_emitted_chars, end)
        return delta

    def _decode_pending(self, final: bool) -> None:
        ids = self.token_ids
        prefix_text = self.tokenizer.decode(ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        new_text = self.tokenizer.decode(ids[self.prefix_offset:], skip_special_tokens=True)
        if len(new_text) <= len(prefix_text) and not final:
            return
        if new_text.endswith(REPLACEMENT_CHAR) and not final:
            return  # the last token ends inside a multi-byte character: wait for the rest
        self.text += new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(ids)

    def _find_stop(self, old_len: int) -> str | None:
        if not self.stop or self.matched_stop is not None or len(self.text) == old_len:
            return None
        # A new match ends in the new text; emitted text holds no stop-string start.
        search_from = max(self.num_emitted_chars, old_len - max(map(len, self.stop)) + 1, 0)
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = self.text.find(stop, search_from)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self.text = self.text[:index + len(stop) if self.include_stop_in_output else index]
        self.matched_stop = stop
        return stop

    def _stop_prefix_len(self) -> int:
        """Length of the longest suffix of the text that begins some stop string."""
        longest = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
