"""The reference offline workload (the logic of shared/bench_workload.py): 256 requests, prompt and
output lengths uniform in 100..1024, fixed seed, EOS ignored."""
from __future__ import annotations

from random import randint, seed


def bench_workload(num_seqs: int = 256, max_input_len: int = 1024,
                   max_output_len: int = 1024) -> tuple[list[list[int]], list[int]]:
    """Returns (prompts, max_tokens): prompts as lists of token ids below 10000."""
    seed(0)
    # Lengths start at 100, as in the reference; smaller maxima (CPU runs) shrink the range.
    min_input_len, min_output_len = min(100, max_input_len), min(100, max_output_len)
    prompts = [[randint(0, 10000) for _ in range(randint(min_input_len, max_input_len))] for _ in range(num_seqs)]
    max_tokens = [randint(min_output_len, max_output_len) for _ in range(num_seqs)]
    return prompts, max_tokens
