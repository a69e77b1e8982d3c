"""Times a bf16 sum all-reduce over the GPUs of one host at the sizes tensor parallelism sends
(a decode batch's hidden states: rows x hidden), replayed inside CUDA graphs as the decode steps
replay them: NCCL (dist.all_reduce) against torch's symmetric-memory one-shot and two-shot
all-reduces. Every method's result is checked against the exact sum first.

    python bench/allreduce_bench.py --hidden 4096 --rows 1,8,64,256,2048
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CALLS_PER_GRAPH = 50


def graph_time_us(fn, replays: int = 20) -> float:
    """Median time of one call of fn, captured CALLS_PER_GRAPH times in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm up outside capture (NCCL and symmetric memory set up lazily)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    times = []
    for _ in range(replays):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS_PER_GRAPH)
    return sorted(times)[len(times) // 2]


def methods(rows: int, hidden: int, device: torch.device, worker_capacity: int) -> dict:
    import torch.distributed._symmetric_memory as symm_mem

    group_name = dist.group.WORLD.group_name
    x = torch.empty(rows, hidden, dtype=torch.bfloat16, device=device)
    symm = symm_mem.empty(rows, hidden, dtype=torch.bfloat16, device=device)
    symm_mem.rendezvous(symm, group_name)
    out = torch.empty_like(x)
    # As the worker sums (distributed.all_reduce): x copied to the front of one larger buffer,
    # reduced back into x.
    big = symm_mem.empty(worker_capacity * hidden, dtype=torch.bfloat16, device=device)
    symm_mem.rendezvous(big, group_name)
    front = big[:rows * hidden].view(rows, hidden)

    def worker_sum() -> None:
        front.copy_(x)
        torch.ops.symm_mem.two_shot_all_reduce_out(front, "sum", group_name, x)

    return {
        "worker-two-shot": (x, worker_sum, lambda: x),
        "nccl": (x, lambda: dist.all_reduce(x), lambda: x),
        "symm-one-shot": (symm, lambda: torch.ops.symm_mem.one_shot_all_reduce_out(symm, "sum", group_name, out),
                          lambda: out),
        "symm-two-shot": (symm, lambda: torch.ops.symm_mem.two_shot_all_reduce_(symm, "sum", group_name),
                          lambda: symm),
    }


def run_rank(rank: int, world: int, port: int, hidden: int, sizes: list[int]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    for rows in sizes:
        line = [f"rows {rows:>5} ({rows * hidden * 2 / 1024:>7.0f} KiB)"]
        for name, (buffer, call, result) in methods(rows, hidden, device, max(sizes)).items():
            try:
                values = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rank), dtype=torch.float32)
                buffer.copy_(values)
                call()
                torch.cuda.synchronize()
                expected = sum(torch.randn(rows, hidden, generator=torch.Generator().manual_seed(r),
                                           dtype=torch.float32).bfloat16().float() for r in range(world))
                error = (result().float().cpu() - expected).abs().max().item()
                line.append(f"{name} {graph_time_us(call):6.1f} us (max err {error:.2g})")
            except Exception as failure:  # a method this torch lacks: say so, go on
                line.append(f"{name} FAILED {failure!r:.80}")
        if rank == 0:
            print(" | ".join(line), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--rows", default="1,8,64,256,2048")
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    if torch.cuda.device_count() < args.world:
        sys.exit(f"needs {args.world} GPUs")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from common.net.ports import free_port

    sizes = [int(part) for part in args.rows.split(",")]
    print(f"{torch.cuda.get_device_name()} x{args.world}, torch {torch.__version__}, "
          f"NCCL_PROTO={os.environ.get('NCCL_PROTO', '')} NCCL_ALGO={os.environ.get('NCCL_ALGO', '')}", flush=True)
    mp.start_processes(run_rank, args=(args.world, free_port(), args.hidden, sizes), nprocs=args.world,
                       start_method="spawn")


if __name__ == "__main__":
    main()
