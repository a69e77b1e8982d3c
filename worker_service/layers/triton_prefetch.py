"""Weights asked of L2 ahead of the products that read them, for decode steps of a few sequences.

At one sequence a decode layer's products (a few MB each) take about twice their weights' read time
on an H200 (bench/decode_chain.py): each starts its reads only when the previous kernel lets it, and
a product's reads take a latency before the bandwidth. The attention in between reads little. A
prefetch kernel launched before the attention asks L2 (50 MB on an H200) for the next products'
weights, so that they are read from L2 when their turn comes.

The kernel reads a table of (address, bytes) chunks made once (`L2Prefetch`), issues one bulk L2
prefetch (`cp.async.bulk.prefetch.L2`, sm_90+) per chunk and thread, and then waits for the previous
kernel like every PDL kernel (layers/triton_pdl): it reads nothing any kernel writes and writes
nothing, so under PDL its prefetches overlap the previous kernel's tail.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from worker_service.layers.triton_pdl import pdl_options, wait_for_previous_kernel
from worker_service.layers.triton_skinny_matmul import MAX_ROWS

ENABLED = True  # benchmarks switch it off for an A/B in one process

CHUNK_BYTES = 8192  # one bulk prefetch a thread
THREADS = 64  # 2 warps: a program prefetches THREADS chunks (45 programs for the 23 MB of a 0.6B layer's MLP)


@triton.jit
def _prefetch_kernel(table_ptr, num_chunks, THREADS: tl.constexpr, PDL: tl.constexpr):
    chunk = tl.minimum(tl.program_id(0) * THREADS + tl.arange(0, THREADS), num_chunks - 1)
    address = tl.load(table_ptr + 2 * chunk)
    size = tl.load(table_ptr + 2 * chunk + 1).to(tl.int32)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                              [address, size], dtype=tl.int32, is_pure=False, pack=1)
    if PDL:
        wait_for_previous_kernel()


class L2Prefetch:
    """Prefetches the given tensors' bytes into L2 with one launch (CUDA, sm_90+)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        chunks = []
        for tensor in tensors:
            if not stageable(tensor):
                raise ValueError("L2Prefetch takes contiguous CUDA tensors of 16-byte aligned addresses and sizes")
            start = tensor.data_ptr()
            chunks += [(start + offset, min(CHUNK_BYTES, tensor.nbytes - offset))
                       for offset in range(0, tensor.nbytes, CHUNK_BYTES)]
        self.table = torch.tensor(chunks, dtype=torch.int64, device=tensors[0].device).view(-1)
        self.num_chunks = len(chunks)
        self.tensors = tensors  # the addresses stay theirs while the table holds them

    def __call__(self) -> None:
        _prefetch_kernel[(triton.cdiv(self.num_chunks, THREADS),)](
            self.table, self.num_chunks, THREADS=THREADS, num_warps=THREADS // 32, **pdl_options(self.table.device))


_plans: dict[tuple[int, ...], L2Prefetch] = {}


def stageable(tensor: torch.Tensor) -> bool:
    """Whether L2Prefetch takes the tensor: on CUDA, contiguous, 16-byte aligned address and size."""
    return tensor.is_cuda and tensor.is_contiguous() and tensor.data_ptr() % 16 == 0 and tensor.nbytes % 16 == 0


def prefetch_weights(weights: Sequence[torch.Tensor], rows: int) -> None:
    """linear.KERNELS["prefetch_weights"] on GPUs: one L2Prefetch launch (made at the first call for these
    weights, kept) when the products reading them take at most MAX_ROWS rows (triton_skinny_matmul's
    decode sizes), on sm_90+ CUDA tensors; nothing otherwise."""
    weights = [weight for weight in weights if stageable(weight)]
    if not (ENABLED and weights and rows <= MAX_ROWS and torch.cuda.get_device_capability(weights[0].device) >= (9, 0)):
        return
    key = tuple(weight.data_ptr() for weight in weights)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = L2Prefetch(list(weights))
    plan()
