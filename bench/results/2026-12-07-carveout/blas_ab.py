"""The script that wrote blas.log: cuBLAS against cuBLASLt (torch.backends.cuda.preferred_blas_library)
on Qwen3-0.6B's four decode products at 1-256 rows, per call from CUDA-graph replays of 40 calls that
cycle through 8 copies of the weight. From the repository root:
    python bench/results/2026-12-07-carveout/blas_ab.py"""
import sys

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
REPS = 40


def time_layer(rows: int) -> dict[str, float]:
    out = {}
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(8)]
        x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
        for w in ws:
            F.linear(x, w)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(REPS):
                F.linear(x, ws[i % 8])
        g.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        out[name] = start.elapsed_time(end) * 1e3 / (10 * REPS)
    return out


def main() -> None:
    libs = sys.argv[1:] or ["cublas", "cublaslt", "cublas", "cublaslt"]
    for lib in libs:
        torch.backends.cuda.preferred_blas_library(lib)
        for rows in (1, 4, 16, 32, 64, 128, 192, 256):
            t = time_layer(rows)
            print(f"{lib:9s} M={rows:4d} " + " ".join(f"{k} {v:6.2f}" for k, v in t.items())
                  + f"  layer {sum(t.values()):6.2f} us", flush=True)


if __name__ == "__main__":
    main()
