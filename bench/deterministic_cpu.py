"""What --deterministic costs on the CPU: the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) through the
offline LLM with and without the mode, in one process, the two taking turns run by run (best of
--repeats rounds: load from elsewhere on a shared machine only slows a run down). The mode's kernels are
process-wide, so each run first installs its own (worker_service.invariant.enable / disable).

    python bench/deterministic_cpu.py [--weight-format int4|float32] [--new-tokens 128] [--streams 16]
                                      [--prefill 512] [--threads 2] [--repeats 3]

Prints decode tok/s of one stream and of --streams streams, prefill tok/s, and each deterministic
figure over the default's (the issue's target: single-stream decode at 0.85 or more).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cpu_default_model import best_interleaved, default_model_inputs, ours_engine  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--weight-format", default="int4", choices=("int4", "float32"))
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill measure")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure; the best is kept")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    from worker_service import invariant

    path, prompts, text_ids = default_model_inputs(args.streams)
    text_ids = text_ids[:args.prefill]
    cpu = torch.device("cpu")
    engines = {"default": ours_engine(path, args.weight_format, args.new_tokens),
               "deterministic": ours_engine(path, args.weight_format, args.new_tokens, deterministic=True)}

    def kernels(name: str, run: Callable[[], float]) -> Callable[[], float]:
        def with_kernels() -> float:
            invariant.enable(cpu) if name == "deterministic" else invariant.disable()
            return run()
        return with_kernels

    for name, engine in engines.items():
        kernels(name, lambda e=engine: e["decode"]([prompts[0]]))()  # warm-up
    measures = {"decode x1": ("decode", [prompts[0]]), f"decode x{args.streams}": ("decode", prompts),
                f"prefill {len(text_ids)}": ("prefill", text_ids)}
    rows: dict[str, dict[str, float]] = {name: {} for name in engines}
    for label, (kind, work) in measures.items():
        runs = {name: kernels(name, lambda e=engine, k=kind, w=work: e[k](w)) for name, engine in engines.items()}
        for name, rate in best_interleaved(args.repeats, runs).items():
            rows[name][label] = rate
        print(label, {name: round(figures[label], 1) for name, figures in rows.items()}, flush=True)
    print(f"\ntok/s, {args.weight_format} weights, {args.threads} threads, {args.new_tokens} new tokens per stream, "
          f"best of {args.repeats}; load average {os.getloadavg()[0]:.2f}")
    print(f"{'':14}" + "".join(f"{label:>14}" for label in measures))
    for name, figures in rows.items():
        print(f"{name:14}" + "".join(f"{figures[label]:>14.1f}" for label in measures))
    print(f"{'ratio':14}" + "".join(f"{rows['deterministic'][label] / rows['default'][label]:>14.2f}"
                                    for label in measures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
