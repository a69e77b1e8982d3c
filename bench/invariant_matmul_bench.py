"""Times --deterministic's batch-invariant product (worker_service/invariant/triton_products) against
what the default path runs (cuBLAS through torch.matmul; the skinny Triton kernel at <= 16 rows), at
Qwen3-0.6B's projection shapes in bf16 on a CUDA device, for decode-sized and prefill-sized row counts.

    python bench/invariant_matmul_bench.py           # the default tilings
    python bench/invariant_matmul_bench.py --sweep   # also block_n x warps x stages at >= 256 rows

Times are triton.testing.do_bench medians; ratio = invariant time / default time.
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton

SHAPES = {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024),
          "head": (1024, 151936)}
ROWS = (1, 16, 64, 256, 2048, 16384)


def bench_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    from worker_service.invariant import triton_products
    from worker_service.layers import triton_skinny_matmul

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"{'layer':<8} {'rows':>6} {'default_us':>11} {'invariant_us':>13} {'ratio':>6}  config")
    for name, (k, n) in SHAPES.items():
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        for m in ROWS:
            if name == "head" and m > 256:
                continue  # the head only computes the rows that sample
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            default = triton_skinny_matmul.linear if m <= triton_skinny_matmul.MAX_ROWS else torch.matmul

            def run_default(x=x, weight=weight, default=default):
                return default(x, weight) if default is not torch.matmul else torch.matmul(x, weight.t())

            base = bench_us(run_default)
            # Row-parallel layers (o, down) take the segmented product, the others the chain.
            product = triton_products.segmented_linear if name in ("o", "down") else triton_products.linear
            configs = [None]
            if args.sweep and m >= 256:
                configs += [triton_products.TileConfig(triton_products.tile_config(m).block_m, block_n, warps, stages)
                            for block_n in (64, 128, 256) for warps in (4, 8) for stages in (3, 4, 5)]
            for config in configs:
                try:
                    took = bench_us(lambda x=x, weight=weight, c=config, f=product: f(x, weight, config=c))
                    print(f"{name:<8} {m:>6} {base:>11.1f} {took:>13.1f} {took / base:>6.2f}  {tuple(config or ())}",
                          flush=True)
                except Exception as error:  # a tiling the compiler rejects (shared memory): report, go on
                    print(f"{name:<8} {m:>6} {tuple(config or ())} FAILED {error!r:.80}", flush=True)


if __name__ == "__main__":
    main()
