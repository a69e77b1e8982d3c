"""Times the fused expert kernels (worker_service/layers/triton_moe) at Qwen3-30B-A3B's shapes (hidden
2048, 128 experts of intermediate 768, 8 per token, bf16) against their weight-read floor.

    python bench/moe_bench.py                 # batches 1, 16, 64, 256, 1024, 4096
    python bench/moe_bench.py --sweep         # also every block configuration of CONFIGS at each batch

Routing is softmax top-k of random logits (what random weights give). The floor is the bytes of the
experts the batch touches (gate, up and down rows of every expert some token picked) over the
device's measured copy bandwidth (read + write of a 4 GiB copy, as bench/throughput.py); the x, hidden
and output traffic is left out of it. Times are triton.testing.do_bench medians, L2 flushed before each
run, of the four launches captured in a CUDA graph (as decode runs them: without the host's launch
time, which outside graphs is ~0.3 ms a call). Every timed configuration is first checked against a loop
over the experts with cuBLAS products, which is also timed (`loop` column) as what a plain implementation costs.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.throughput import measure_copy_bandwidth  # noqa: E402
from worker_service.layers.triton_moe import MoeConfig, align, fused_experts, moe_config  # noqa: E402

HIDDEN, INTER, NUM_EXPERTS, TOP_K = 2048, 768, 128, 8
BATCHES = (1, 16, 64, 256, 1024, 4096)
CONFIGS = [MoeConfig(16, 32, 128, 4, 4), MoeConfig(16, 64, 128, 4, 4), MoeConfig(16, 32, 256, 4, 3),
           MoeConfig(16, 64, 64, 4, 5), MoeConfig(32, 64, 128, 4, 4), MoeConfig(64, 64, 64, 4, 4),
           MoeConfig(64, 128, 64, 4, 4), MoeConfig(128, 128, 64, 8, 3)]


def loop_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
    """The plain version: each expert that got tokens, as two cuBLAS products (host syncs included)."""
    out = torch.zeros_like(x, dtype=torch.float32)
    for expert in torch.unique(ids).tolist():
        tokens, slots = torch.nonzero(ids == expert, as_tuple=True)
        gate_up = x[tokens] @ w13[expert].T
        hidden = F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:]
        out.index_add_(0, tokens, (hidden @ w2[expert].T).float() * weights[tokens, slots, None])
    return out.to(x.dtype)


def bench_ms(fn, *args: object) -> float:
    return triton.testing.do_bench(lambda: fn(*args), warmup=10, rep=100, return_mode="median")


def graph_ms(fn, *args: object) -> float:
    """fn(*args) captured in a CUDA graph, as decode runs it: the kernels' time without the host's launches."""
    fn(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*args)
    return bench_ms(graph.replay)


def config_name(config: MoeConfig) -> str:
    return f"m{config.block_m} n{config.block_n} k{config.block_k} w{config.num_warps} s{config.num_stages}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time every configuration of CONFIGS too")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    torch.manual_seed(0)
    bandwidth = measure_copy_bandwidth()
    w13 = (torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, device="cuda") * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(NUM_EXPERTS, HIDDEN, INTER, device="cuda") * 0.02).to(torch.bfloat16)
    expert_bytes = 3 * INTER * HIDDEN * 2
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s; Qwen3-30B-A3B experts "
          f"({NUM_EXPERTS} x 3 x {INTER} x {HIDDEN} bf16, top {TOP_K})")
    print(f"{'tokens':>6} {'touched':>7} {'config':<26} {'fused_us':>9} {'floor_us':>9} {'of floor':>8} "
          f"{'loop_us':>9} {'rel_err':>8}")
    for batch in BATCHES:
        logits = torch.randn(batch, NUM_EXPERTS, device="cuda")
        weights, ids = logits.softmax(-1).topk(TOP_K, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        x = torch.randn(batch, HIDDEN, device="cuda").to(torch.bfloat16)
        touched = int(torch.unique(ids).numel())
        floor_us = touched * expert_bytes / bandwidth * 1e6
        reference = loop_experts(x, w13, w2, ids, weights)
        loop_us = bench_ms(loop_experts, x, w13, w2, ids, weights) * 1e3
        align_us = graph_ms(align, ids, 0, NUM_EXPERTS, moe_config(batch * TOP_K, NUM_EXPERTS).block_m) * 1e3
        print(f"{batch:>6} tokens: the align kernel alone {align_us:.1f} us")
        default = moe_config(batch * TOP_K, NUM_EXPERTS)
        for config in [default, *(c for c in CONFIGS if c != default)] if args.sweep else [default]:
            out = fused_experts(x, w13, w2, ids, weights, 0, config)
            error = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
            fused_us = graph_ms(fused_experts, x, w13, w2, ids, weights, 0, config) * 1e3
            name = ("*" if config == default else " ") + config_name(config)
            print(f"{batch:>6} {touched:>7} {name:<26} {fused_us:>9.1f} {floor_us:>9.1f} {floor_us / fused_us:>8.2f} "
                  f"{loop_us:>9.1f} {error:>8.1e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
