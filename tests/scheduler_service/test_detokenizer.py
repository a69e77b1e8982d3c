"""Incremental detokenization: whole characters only, stop strings neither leaked nor lost."""
from __future__ import annotations

import pytest

from scheduler_service.api.tokenizer import Tokenizer, load_tokenizer
from scheduler_service.core.detokenizer import IncrementalDetokenizer
from tests.tiny_models import save_tiny_bpe_tokenizer

TEXTS = [
    "Ça coûte combien? 🤖🚀 日本語のテキスト",
    "The quick brown fox jumps over the lazy dog.",
    "∑ ∞ ≈ → naïve façade, Über.",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return load_tokenizer(str(save_tiny_bpe_tokenizer(tmp_path_factory.mktemp("bpe"))))


def stream(tokenizer: Tokenizer, text: str, prompt: list[int], stop: tuple[str, ...] = (),
           include_stop: bool = False) -> tuple[list[str], IncrementalDetokenizer, int]:
    """Feeds text's tokens one by one; returns the deltas, the detokenizer and the tokens consumed."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, stop, include_stop)
    deltas = []
    ids = tokenizer.encode(text, add_special_tokens=False)
    for count, token_id in enumerate(ids, start=1):
        if detokenizer.add_token(token_id) is not None:
            deltas.append(detokenizer.take_delta(finished=True))
            return deltas, detokenizer, count
        deltas.append(detokenizer.take_delta(finished=False))
    detokenizer.finish()
    deltas.append(detokenizer.take_delta(finished=True))
    return deltas, detokenizer, len(ids)


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_characters_arrive_whole(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    # The test means something only if some token alone is not valid UTF-8.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids) or text == TEXTS[1]
    deltas, _, _ = stream(tokenizer, text, prompt=tokenizer.encode("Hello there"))
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == text


def test_stop_string_split_across_tokens_is_not_leaked(tokenizer: Tokenizer) -> None:
    text = TEXTS[1]
    stop = "brown fox"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert stop not in pieces  # the stop string spans several tokens
    deltas, detokenizer, consumed = stream(tokenizer, text, prompt=[], stop=(stop,))
    assert detokenizer.matched_stop == stop
    assert "".join(deltas) == "The quick "
    assert not any(part in "".join(deltas) for part in ("b", "br", "brown"))
    assert consumed < len(ids)


def test_stop_string_included_when_asked(tokenizer: Tokenizer) -> None:
    deltas, detokenizer, _ = stream(tokenizer, TEXTS[1], prompt=[], stop=("brown fox",), include_stop=True)
    assert "".join(deltas) == "The quick brown fox"


def test_possible_stop_prefix_is_held_then_released(tokenizer: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, [], ("quick brown cat",))
    released = []
    for token_id in tokenizer.encode(TEXTS[1], add_special_tokens=False):
        assert detokenizer.add_token(token_id) is None
        released.append(detokenizer.take_delta(finished=False))
    # "quick brown " was held back while it could still become the stop string.
    held_at_some_point = any(d.startswith("quick brown ") for d in released)
    assert held_at_some_point
    detokenizer.finish()
    released.append(detokenizer.take_delta(finished=True))
    assert "".join(released) == TEXTS[1]


def test_earliest_of_several_stop_strings_wins(tokenizer: Tokenizer) -> None:
    deltas, detokenizer, _ = stream(tokenizer, TEXTS[1], prompt=[], stop=("lazy", "fox"))
    assert detokenizer.matched_stop == "fox"
    assert "".join(deltas) == "The quick brown "
