"""Where the GPU time of a generation goes: runs the reference workload (or a slice of it)
in-process under torch.profiler and prints the wall time, the GPU's busy time (the sum of kernel
times: one stream, so kernels do not overlap), the kernels that take the most device time, the GPU's
idle time in slices of the run, and the kernel boundaries that leave it idle longest.

    python bench/profile_decode.py [--num-seqs 256] [--max-len 1024] [--num-decode-steps 4] [--kv-cache-dtype fp8]
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.workload import add_workload_arguments, warmed_up_workload

    parser = argparse.ArgumentParser()
    add_workload_arguments(parser)
    parser.add_argument("--rows", type=int, default=40)
    parser.add_argument("--bins", type=int, default=20, help="slices of the run in the idle timeline")
    parser.add_argument("--gap-rows", type=int, default=12,
                        help="kernel boundaries listed, the most idle time first")
    args = parser.parse_args()
    llm, prompts, params = warmed_up_workload(args)
    gc_pauses = record_gc_pauses()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
    gc.callbacks.remove(gc_pauses.callback)
    print(f"gc: {len(gc_pauses.seconds)} collections, {sum(gc_pauses.seconds) * 1e3:.1f} ms in all, the longest "
          f"{max(gc_pauses.seconds, default=0) * 1e3:.1f} ms; allocator retries (cudaFree + retry): "
          f"{torch.cuda.memory_stats().get('num_alloc_retries', 0)}")
    averages = prof.key_averages()
    busy_us = sum(event.self_device_time_total for event in averages)
    print(f"wall {wall:.3f} s (under the profiler), GPU busy {busy_us / 1e6:.3f} s ({busy_us / 1e6 / wall:.0%})")
    print(f"{'us total':>12} {'share':>6} {'calls':>8} {'us/call':>8}  kernel")
    for event in sorted(averages, key=lambda e: e.self_device_time_total, reverse=True)[:args.rows]:
        total = event.self_device_time_total
        print(f"{total:>12.0f} {total / busy_us:>6.1%} {event.count:>8} {total / max(event.count, 1):>8.1f}  "
              f"{event.key[:110]}")
    spans = kernel_spans(prof.events())
    print_idle_timeline(spans, args.bins)
    print_idle_by_boundary(spans, args.gap_rows)
    return 0


class GcPauses:
    """Durations of the garbage collector's runs, through gc.callbacks."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._started = 0.0

    def callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds.append(time.perf_counter() - self._started)


def record_gc_pauses() -> GcPauses:
    pauses = GcPauses()
    gc.callbacks.append(pauses.callback)
    return pauses


def print_idle_timeline(spans: list[tuple[float, float, str]], num_bins: int) -> None:
    """The GPU's idle time in equal slices of the run (gaps between consecutive kernels), so
    that idle phases (host-bound steps) show where in the run they are."""
    if not spans:
        return
    first, last = spans[0][0], max(end for _, end, _ in spans)
    width = (last - first) / num_bins
    idle = [0.0] * num_bins
    kernels = [0] * num_bins
    big_gaps = [0] * num_bins
    for start, gap, _, _ in idle_gaps(spans):
        slot = min(int((start - first) / width), num_bins - 1)
        kernels[slot] += 1
        idle[slot] += gap
        big_gaps[slot] += gap > 100
    total_idle = sum(idle)
    print(f"GPU idle between kernels: {total_idle / 1e6:.3f} s of {(last - first) / 1e6:.3f} s")
    print(f"{'slice ms':>10} {'idle ms':>9} {'idle':>6} {'kernels':>8} {'gaps>100us':>10}")
    for index in range(num_bins):
        print(f"{(index * width) / 1e3:>10.0f} {idle[index] / 1e3:>9.1f} {idle[index] / width:>6.0%} "
              f"{kernels[index]:>8} {big_gaps[index]:>10}")


def print_idle_by_boundary(spans: list[tuple[float, float, str]], num_rows: int) -> None:
    """The GPU's idle time summed by the pair of kernels around each gap (the one that ended last, the one
    that started next), largest first: which boundaries of a step leave the device waiting."""
    idle: dict[tuple[str, str], list[float]] = {}
    for _, gap, before, after in idle_gaps(spans):
        if gap > 0:
            entry = idle.setdefault((before[:48], after[:48]), [0.0, 0])
            entry[0] += gap
            entry[1] += 1
    print(f"{'idle ms':>9} {'gaps':>7} {'us/gap':>7}  kernel before the gap -> kernel after it")
    for (before, after), (total, count) in sorted(idle.items(), key=lambda item: -item[1][0])[:num_rows]:
        print(f"{total / 1e3:>9.1f} {count:>7} {total / count:>7.1f}  {before} -> {after}")


def kernel_spans(events) -> list[tuple[float, float, str]]:
    """(start, end, name) of the profiler's device events (kernels, copies), by start time (us)."""
    from torch.autograd import DeviceType

    return sorted((e.time_range.start, e.time_range.end, e.name) for e in events if e.device_type == DeviceType.CUDA)


def idle_gaps(spans: list[tuple[float, float, str]]) -> Iterator[tuple[float, float, str, str]]:
    """For every span after the first (kernel_spans): its start, the idle time before it (0 when an
    earlier span still runs: overlapping kernels are one busy stretch), the name of the span that ended
    last before it, and its own name."""
    if not spans:
        return
    reach, last_name = spans[0][1], spans[0][2]
    for start, end, name in spans[1:]:
        yield start, max(0.0, start - reach), last_name, name
        if end >= reach:
            reach, last_name = end, name


if __name__ == "__main__":
    sys.exit(main())
