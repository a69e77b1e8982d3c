"""The reference offline workload (the logic of shared/bench_workload.py): 256 requests, prompt and
output lengths uniform in 100..1024, fixed seed, EOS ignored; and the warmed-up offline engine that the
profiling benches run it on."""
from __future__ import annotations

import argparse
from pathlib import Path
from random import randint, seed
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common import SamplingParams
    from offline import LLM


def bench_workload(num_seqs: int = 256, max_input_len: int = 1024,
                   max_output_len: int = 1024) -> tuple[list[list[int]], list[int]]:
    """Returns (prompts, max_tokens): prompts as lists of token ids below 10000."""
    seed(0)
    # Lengths start at 100, as in the reference; smaller maxima (CPU runs) shrink the range.
    min_input_len, min_output_len = min(100, max_input_len), min(100, max_output_len)
    prompts = [[randint(0, 10000) for _ in range(randint(min_input_len, max_input_len))] for _ in range(num_seqs)]
    max_tokens = [randint(min_output_len, max_output_len) for _ in range(num_seqs)]
    return prompts, max_tokens


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of warmed_up_workload (bench/profile_decode.py's and bench/step_host_times.py's)."""
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--num-decode-steps", type=int, default=4)
    parser.add_argument("--work-dir", default="/tmp/nanovllm-bench")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto (the model dtype) or fp8")


def warmed_up_workload(args: argparse.Namespace) -> tuple[LLM, list[list[int]], list[SamplingParams]]:
    """(the offline engine on the random Qwen3-0.6B, the reference workload's prompts and sampling params)
    as add_workload_arguments' options ask, after a warm-up generation of 8 of the prompts."""
    from bench.random_checkpoint import make_random_checkpoint
    from common import SamplingParams
    from offline import LLM

    model = make_random_checkpoint(Path(args.work_dir) / "random-qwen3-0.6b")
    llm = LLM(str(model), max_model_len=4096, num_decode_steps=args.num_decode_steps,
              kv_cache_dtype=args.kv_cache_dtype)
    prompts, max_tokens = bench_workload(args.num_seqs, args.max_len, args.max_len)
    params = [SamplingParams(temperature=0.6, max_tokens=m, ignore_eos=True) for m in max_tokens]
    llm.generate(prompts[:8], params[:8], use_tqdm=False)
    return llm, prompts, params
