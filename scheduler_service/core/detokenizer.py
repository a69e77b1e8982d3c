"""Incremental detokenization with stop strings.

Each new token decodes in O(1) against a short window of earlier tokens, so that the text of a
token whose meaning depends on its neighbours (a leading space, a multi-byte character split over
tokens) comes out right. A delta never ends inside a UTF-8 character, and text that could be the
start of a stop string is held back until it is decided; the tail is flushed when the sequence ends.

The new text is the window's text past the length of the prefix window's (the tokens before the
new ones, decoded alone). That length is not the previous delta's (a SentencePiece decoder drops
the leading space of a window's first token), so it is decoded, but once per window rather than
once per token; and a window of one token, the steady state, takes it from a cache of each token's
length shared by all sequences of a tokenizer. So one decode per token, where there were two.
"""
from __future__ import annotations

import weakref
from typing import Protocol

# Tokens of the prompt kept as context for decoding the first output tokens.
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class TokenDecoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


# tokenizer -> {token id: characters it decodes to alone}; at most one entry per vocabulary token.
_TOKEN_TEXT_LENS: weakref.WeakKeyDictionary[TokenDecoder, dict[int, int]] = weakref.WeakKeyDictionary()


def _token_text_lens(tokenizer: TokenDecoder) -> dict[int, int]:
    try:
        return _TOKEN_TEXT_LENS.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable or not hashable: a cache for this sequence alone
        return {}


class IncrementalDetokenizer:
    def __init__(self, tokenizer: TokenDecoder, prompt_token_ids: list[int], stop: tuple[str, ...] = (),
                 include_stop_in_output: bool = False) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop_in_output = include_stop_in_output
        self.token_ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self._prefix_text_len: int | None = None  # of token_ids[prefix_offset:read_offset], once decoded
        self._token_text_lens = _token_text_lens(tokenizer)
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
        prefix_len = self._prefix_len()
        new_text = self.tokenizer.decode(ids[self.prefix_offset:], skip_special_tokens=True)
        if len(new_text) <= prefix_len and not final:
            return
        if new_text.endswith(REPLACEMENT_CHAR) and not final:
            return  # the last token ends inside a multi-byte character: wait for the rest
        self.text += new_text[prefix_len:]
        self.prefix_offset = self.read_offset
        self.read_offset = len(ids)
        self._prefix_text_len = None

    def _prefix_len(self) -> int:
        """Characters of token_ids[prefix_offset:read_offset] decoded alone."""
        if self._prefix_text_len is None:
            start, end = self.prefix_offset, self.read_offset
            if end - start == 1:
                token_id = self.token_ids[start]
                length = self._token_text_lens.get(token_id)
                if length is None:
                    length = self._token_text_lens[token_id] = len(self.tokenizer.decode([token_id],
                                                                                      skip_special_tokens=True))
            else:
                length = len(self.tokenizer.decode(self.token_ids[start:end], skip_special_tokens=True))
            self._prefix_text_len = length
        return self._prefix_text_len

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
