"""Times the Triton skinny matmul (worker_service/layers/triton_skinny_matmul.py) against cuBLAS
(F.linear) and torch.mv on a CUDA device, bf16, at the decode shapes of Qwen3-0.6B and a 7B model.

    python bench/skinny_matmul_bench.py            # the table (well under a minute on an H200)
    python bench/skinny_matmul_bench.py --sweep    # also a grid of block sizes per shape and rows
    python bench/skinny_matmul_bench.py --sweep --rows 1,16 --shapes 1024x2048   # a part of it

Each time is per call, from CUDA events around replays of a CUDA graph of 64 calls (no launch
overhead, as in a decode step's graph), and also from 64 eager calls (with it). The calls cycle
through enough copies of the weight to span three times the L2 cache, so the weight comes from HBM as
in a real forward pass, where each layer's weights are read once. Bandwidth is the weight's bytes
(N * K * 2) over the time. Every skinny result is first checked against F.linear in float32.

--blas-libraries cublas,cublaslt times only F.linear, once per library torch is told to prefer
(torch.backends.cuda.preferred_blas_library), at any number of rows (the skinny kernel takes at most 16):

    python bench/skinny_matmul_bench.py --blas-libraries cublas,cublaslt --rows 1,16,64,128,256 \
        --shapes 4096x1024,1024x2048,6144x1024,1024x3072

--sweep compiles every candidate in parallel processes first (Triton's disk cache then serves the
timed runs), then prints, per shape and number of rows, the fastest configs beside _config's choice.
"""
from __future__ import annotations

import argparse
import itertools
import math
import multiprocessing
import os
import statistics
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker_service.layers.triton_skinny_matmul import SkinnyConfig, _config, skinny_linear  # noqa: E402

# (N, K): Qwen3-0.6B's gate_up, qkv, o_proj, down_proj; a 7B model's gate_up and a square projection.
SHAPES = [(6144, 1024), (4096, 1024), (1024, 2048), (1024, 3072), (24576, 4096), (4096, 4096)]
ROWS = [1, 2, 4, 8, 16]
DTYPE = torch.bfloat16
CALLS = 64  # calls per CUDA graph (and per eager timing)
REPLAYS = 10  # timed replays of each graph; the median counts
Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def weight_copies(n: int, k: int) -> list[torch.Tensor]:
    """Copies of a random W [n, k] spanning 3x the L2 (at most CALLS), so calls read HBM."""
    l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    count = max(1, min(CALLS, math.ceil(3 * l2_bytes / (n * k * 2))))
    return [torch.randn(n, k, device="cuda", dtype=DTYPE) / k**0.5 for _ in range(count)]


def time_graph_us(fn: Linear, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    fn(x, weights[0])  # compiles (Triton) and sets up (cuBLAS) before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            fn(x, weights[i % len(weights)])
    graph.replay()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(REPLAYS + 1)]
    events[0].record()
    for event in events[1:]:
        graph.replay()
        event.record()
    torch.cuda.synchronize()
    times = [start.elapsed_time(end) for start, end in itertools.pairwise(events)]
    del graph
    return statistics.median(times) * 1000 / CALLS


def time_eager_us(fn: Linear, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    for i in range(8):
        fn(x, weights[i % len(weights)])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for i in range(CALLS):
        fn(x, weights[i % len(weights)])
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / CALLS


def relative_error(fn: Linear, x: torch.Tensor, weight: torch.Tensor, expected: torch.Tensor) -> float:
    """‖fn(x, W) - expected‖ / ‖expected‖, expected = F.linear in float32."""
    return ((fn(x, weight).float() - expected).norm() / expected.norm()).item()


def skinny(config: SkinnyConfig | None) -> Linear:
    return lambda x, weight: skinny_linear(x, weight, config=config)


def gbs(n: int, k: int, time_us: float) -> float:
    return n * k * 2 / time_us / 1e3


def table(shapes: list[tuple[int, int]], rows: list[int]) -> None:
    print(f"{'N':>6} {'K':>5} {'M':>3} | {'cuBLAS us':>9} {'GB/s':>6} | {'skinny us':>9} {'GB/s':>6} {'speedup':>7} | "
          f"{'mv us':>6} | {'eager: cuBLAS':>13} {'skinny':>7} | {'rel err':>7}  config")
    layer = {m: [0.0, 0.0] for m in rows}  # Qwen3-0.6B's four projections: cuBLAS, skinny us
    for n, k in shapes:
        weights = weight_copies(n, k)
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            error = relative_error(skinny(None), x, weights[0], F.linear(x.float(), weights[0].float()))
            cublas_us = time_graph_us(F.linear, x, weights)
            skinny_us = time_graph_us(skinny(None), x, weights)
            mv = f"{time_graph_us(lambda x, w: torch.mv(w, x[0]), x, weights):6.2f}" if m == 1 else f"{'':>6}"
            eager = time_eager_us(F.linear, x, weights), time_eager_us(skinny(None), x, weights)
            if (n, k) in SHAPES[:4]:
                layer[m][0] += cublas_us
                layer[m][1] += skinny_us
            print(f"{n:>6} {k:>5} {m:>3} | {cublas_us:>9.2f} {gbs(n, k, cublas_us):>6.0f} | {skinny_us:>9.2f} "
                  f"{gbs(n, k, skinny_us):>6.0f} {cublas_us / skinny_us:>6.2f}x | {mv} | {eager[0]:>13.2f} "
                  f"{eager[1]:>7.2f} | {error:>7.1e}  {tuple(_config(m, n, k))}", flush=True)
        del weights
    for m, (cublas_us, skinny_us) in layer.items():
        print(f"Qwen3-0.6B layer (gate_up + qkv + o + down of those measured), M={m}: cuBLAS {cublas_us:.1f} us, "
              f"skinny {skinny_us:.1f} us")


def blas_table(shapes: list[tuple[int, int]], rows: list[int], libraries: list[str]) -> None:
    """F.linear per call under each BLAS library, and the sum over the shapes per number of rows."""
    for library in libraries:
        torch.backends.cuda.preferred_blas_library(library)
        total = dict.fromkeys(rows, 0.0)
        for n, k in shapes:
            weights = weight_copies(n, k)
            for m in rows:
                time_us = time_graph_us(F.linear, torch.randn(m, k, device="cuda", dtype=DTYPE), weights)
                total[m] += time_us
                print(f"{library:9} N={n:>5} K={k:>4} M={m:>3}: {time_us:6.2f} us {gbs(n, k, time_us):6.0f} GB/s",
                      flush=True)
            del weights
        for m, time_us in total.items():
            print(f"{library:9} M={m:>3}: the shapes together {time_us:6.2f} us")


def candidates(m: int, n: int, k: int) -> list[SkinnyConfig]:
    """The sweep's grid: CUDA-core tiles of 1K..16K weight elements at 4 and 8 warps, unpipelined and
    3 deep; tensor-core tiles whose pipeline stages fit in shared memory."""
    configs = []
    max_block_k = triton.next_power_of_2(k)
    for block_n, block_k, warps, stages in itertools.product((1, 2, 4, 8, 16), (256, 512, 1024, 2048, 4096),
                                                             (4, 8), (1, 3)):
        if 1024 <= block_n * block_k <= 16384 and block_k <= max_block_k:
            configs.append(SkinnyConfig(block_n, block_k, warps, stages, False))
    for block_n, block_k, stages in itertools.product((16, 32, 64), (64, 128, 256, 512), (2, 3, 4, 5)):
        if stages * (block_n + 16) * block_k * 2 <= 160 * 1024 and block_k <= max_block_k:
            configs.append(SkinnyConfig(block_n, block_k, 4, stages, True))
    default = _config(m, n, k)
    return configs if default in configs else [*configs, default]


def _compile_one(job: tuple[int, int, int, SkinnyConfig]) -> str | None:
    """Runs one config once (in a worker process), leaving its binary in Triton's disk cache."""
    m, n, k, config = job
    try:
        skinny_linear(torch.zeros(m, k, device="cuda", dtype=DTYPE), torch.zeros(n, k, device="cuda", dtype=DTYPE),
                      config=config)
        torch.cuda.synchronize()
        return None
    except Exception as error:  # a config the compiler rejects (too much shared memory, say) is reported
        return f"{config}: {type(error).__name__}: {str(error)[:200]}"


def precompile(jobs: list[tuple[int, int, int, SkinnyConfig]]) -> None:
    """Compiles each distinct kernel of jobs once, in parallel processes. Integers reach the compiler only
    as Triton's specialisations (== 1, % 16 == 0), so a 16- or 8-row weight stands in for the real one."""
    distinct = {}
    for m, n, k, config in jobs:
        block_m = 16 if config.use_dot else triton.next_power_of_2(m)
        key = (block_m, m == 1, m % 16 == 0, n % 16 == 0, k % 16 == 0, k % config.block_k == 0, config)
        distinct.setdefault(key, (m, 16 if n % 16 == 0 else 8, k, config))
    workers = min(16, os.cpu_count() or 1)
    print(f"compiling {len(distinct)} kernels in {workers} processes ...", flush=True)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for failure in pool.map(_compile_one, distinct.values()):
            if failure:
                print("  failed:", failure)


def sweep(shapes: list[tuple[int, int]], rows: list[int], top: int) -> None:
    precompile([(m, n, k, config) for n, k in shapes for m in rows for config in candidates(m, n, k)])
    summary = []
    for n, k in shapes:
        weights = weight_copies(n, k)
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            expected = F.linear(x.float(), weights[0].float())
            results = []
            for config in candidates(m, n, k):
                try:
                    error = relative_error(skinny(config), x, weights[0], expected)
                    if not error < 1e-2:
                        print(f"  wrong result ({error:.1e}): {tuple(config)}")
                        continue
                    results.append((time_graph_us(skinny(config), x, weights), config))
                except Exception as exception:  # a rejected config must not end the sweep
                    print(f"  skipped {tuple(config)}: {type(exception).__name__}")
            if not results:
                print(f"N={n} K={k} M={m}: no config ran")
                continue
            results.sort()
            chosen = next((t for t, config in results if config == _config(m, n, k)), float("nan"))
            cublas_us = time_graph_us(F.linear, x, weights)
            print(f"N={n} K={k} M={m}: cuBLAS {cublas_us:.2f} us; _config {tuple(_config(m, n, k))} {chosen:.2f} us")
            for time_us, config in results[:top]:
                print(f"    {time_us:7.2f} us {gbs(n, k, time_us):6.0f} GB/s  {tuple(config)}")
            summary.append((n, k, m, cublas_us, chosen, *results[0]))
        del weights
    print("\nbest per shape (block_n, block_k, num_warps, num_stages, use_dot):")
    for n, k, m, cublas_us, chosen, best_us, best in summary:
        print(f"  N={n:>5} K={k:>4} M={m:>2}: cuBLAS {cublas_us:6.2f}  _config {chosen:6.2f}  best {best_us:6.2f} us "
              f"({gbs(n, k, best_us):4.0f} GB/s) {tuple(best)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="also sweep block sizes, warps, stages per shape")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="rows of x (M), comma-separated")
    parser.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES), help="NxK, comma-separated")
    parser.add_argument("--top", type=int, default=3, help="configs shown per shape in the sweep")
    parser.add_argument("--blas-libraries", help="only F.linear, under each of these (comma-separated)")
    args = parser.parse_args()
    rows = [int(m) for m in args.rows.split(",")]
    shapes = [tuple(int(side) for side in shape.split("x")) for shape in args.shapes.split(",")]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, {DTYPE}")
    if args.blas_libraries:
        blas_table(shapes, rows, args.blas_libraries.split(","))
        return
    table(shapes, rows)
    if args.sweep:
        sweep(shapes, rows, args.top)


if __name__ == "__main__":
    main()
