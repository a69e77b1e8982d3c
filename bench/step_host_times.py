"""Where the host's time goes in the steps of a generation: runs the reference workload (or a slice of it)
on the offline engine, without a profiler, timing the worker's step launch and its parts, and the
read-back's wait for the GPU.

    python bench/step_host_times.py [--num-seqs 256] [--max-len 1024] [--kv-cache-dtype fp8]

A step is launched (inputs copied, forward passes and sampling queued) before the previous one is read
back, so the GPU never waits while the host is ahead. The table says whether it is: the read-back's
wait is the time the host had to spare; a launch that takes about a step's GPU time blocked on the GPU
(bench/results/2026-12-07-h100-host-gaps.md). bench/profile_decode.py gives the GPU's side.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.workload import add_workload_arguments, warmed_up_workload  # noqa: E402
from worker_service.models.llama import LlamaForCausalLM  # noqa: E402
from worker_service.runtime.model_runner import ModelRunner  # noqa: E402
from worker_service.runtime.worker import WorkerCore  # noqa: E402

# (row label, class, method): the launch, its parts, and the read-back's wait (the one Event.synchronize
# of a step: PendingStep.result's).
TIMED = [
    ("step launch", WorkerCore, "launch"),
    ("  forward passes", ModelRunner, "_forward"),
    ("  output head", LlamaForCausalLM, "compute_logits"),
    ("  sampling", ModelRunner, "_sample"),
    ("read-back wait for the GPU", torch.cuda.Event, "synchronize"),
]


@contextlib.contextmanager
def timed_methods(targets: list[tuple[str, type, str]]) -> Iterator[dict[str, list[float]]]:
    """Within the block each (label, owner, method) records its calls' durations (seconds) under label;
    the methods are restored after it."""
    times: dict[str, list[float]] = {label: [] for label, _, _ in targets}
    originals = [(owner, name, owner.__dict__[name]) for _, owner, name in targets]
    for (label, owner, name), (_, _, original) in zip(targets, originals, strict=True):
        setattr(owner, name, _timer(original, times[label]))
    try:
        yield times
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def _timer(method: Callable[..., Any], durations: list[float]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            durations.append(time.perf_counter() - started)

    return timed


def print_table(times: dict[str, list[float]], wall_s: float) -> None:
    print(f"wall {wall_s:.3f} s")
    print(f"{'':28} {'calls':>6} {'total ms':>9} {'median us':>10} {'p90 us':>8} {'max us':>8}")
    for label, durations in times.items():
        if not durations:
            print(f"{label:28} {0:>6}")
            continue
        ordered = sorted(durations)
        print(f"{label:28} {len(ordered):>6} {sum(ordered) * 1e3:>9.1f} {statistics.median(ordered) * 1e6:>10.0f} "
              f"{ordered[int(0.9 * (len(ordered) - 1))] * 1e6:>8.0f} {ordered[-1] * 1e6:>8.0f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser)
    llm, prompts, params = warmed_up_workload(parser.parse_args())
    with timed_methods(TIMED) as times:
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall_s = time.perf_counter() - started
    print_table(times, wall_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
