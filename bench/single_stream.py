"""Where one stream's time goes, in-process (no gRPC): the first token of a fresh prompt (TTFT)
and the time per output token (ITL) on the random Qwen3-0.6B, then one prefill and a run of
decode iterations under torch.profiler: wall time, the GPU's busy time, the number of kernels and
the kernels that take the time. The gRPC figures come from bench/serving.py's single-stream points.

    python bench/single_stream.py [--prompt-lens 512,2048] [--output-len 256] [--num-decode-steps 4]
                                  [--without-pdl]   # the Triton kernels without programmatic dependent launch
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    from bench.random_checkpoint import make_random_checkpoint
    from offline import LLM

    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt-lens", default="512,2048")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-decode-steps", type=int, default=4)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--work-dir", default="/tmp/nanovllm-bench")
    parser.add_argument("--cprofile", action="store_true", help="also the Python functions of one 512-token prefill")
    parser.add_argument("--model", help="a checkpoint folder (default: the random Qwen3-0.6B, made once)")
    parser.add_argument("--without-pdl", action="store_true",
                        help="launch the decode step's Triton kernels without PDL (layers/triton_pdl), for an A/B")
    args = parser.parse_args()
    if args.without_pdl:
        from worker_service.layers import triton_pdl

        triton_pdl.ENABLED = False
    model = args.model or make_random_checkpoint(Path(args.work_dir) / "random-qwen3-0.6b")
    with LLM(str(model), max_model_len=4096, num_decode_steps=args.num_decode_steps) as llm:
        rng = random.Random(0)
        vocab = llm.worker.describe().vocab_size

        def prompt(length: int) -> list[int]:
            return [rng.randrange(vocab) for _ in range(length)]

        run(llm, prompt(64), 8)  # warm-up: compiles and tunes what the first call would
        for prompt_len in [int(n) for n in args.prompt_lens.split(",")]:
            run(llm, prompt(prompt_len), 2)
            ttfts = [run(llm, prompt(prompt_len), 1) for _ in range(args.repeats)]
            totals = [run(llm, prompt(prompt_len), args.output_len + 1) for _ in range(args.repeats)]
            ttft = statistics.median(ttfts)
            itl = (statistics.median(totals) - ttft) / args.output_len
            print(f"prompt {prompt_len}: in-process TTFT {ttft * 1e3:.2f} ms (median of {args.repeats}), "
                  f"ITL {itl * 1e3:.3f} ms over {args.output_len} tokens, num_decode_steps {args.num_decode_steps}, "
                  f"PDL {'off' if args.without_pdl else 'on'}")
        profiled(llm, "prefill of 512 tokens, one output token", prompt(512), 1, args.rows)
        if args.cprofile:
            python_profile(llm, prompt(512), args.rows)
        profiled(llm, "16-token prompt, 129 output tokens (decode)", prompt(16), 129, args.rows)
    return 0


def run(llm, prompt: list[int], max_tokens: int) -> float:
    import torch

    from common import SamplingParams

    params = SamplingParams(temperature=0.6, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    llm.generate([prompt], [params], use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - started


def profiled(llm, title: str, prompt: list[int], max_tokens: int, rows: int) -> None:
    """One generate call under the profiler: its kernels, and the host-side operators that take the
    most CPU time (what a host-bound step spends its time on)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = run(llm, prompt, max_tokens)
    averages = prof.key_averages()
    kernels = [e for e in averages if e.self_device_time_total > 0]
    busy_us = sum(e.self_device_time_total for e in kernels)
    num_kernels = sum(e.count for e in kernels)
    print(f"\n== {title}: wall {wall * 1e3:.2f} ms under the profiler, GPU busy {busy_us / 1e3:.2f} ms, "
          f"{num_kernels} kernels")
    print(f"{'us total':>10} {'calls':>6} {'us/call':>8}  kernel")
    for event in sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:rows]:
        print(f"{event.self_device_time_total:>10.0f} {event.count:>6} "
              f"{event.self_device_time_total / event.count:>8.1f}  {event.key[:100]}")
    print(f"{'cpu us self':>11} {'calls':>6}  host operator")
    for event in sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:rows]:
        print(f"{event.self_cpu_time_total:>11.0f} {event.count:>6}  {event.key[:100]}")


def python_profile(llm, prompt: list[int], rows: int) -> None:
    """The host's Python time of one prefill step, by function (cProfile's own time)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    run(llm, prompt, 1)
    profiler.disable()
    print("\n== Python functions of one 512-token prefill (cProfile, own time)")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(rows)


if __name__ == "__main__":
    sys.exit(main())
