"""The batch-invariant CPU attention backend (torch-invariant): a query's output is the same bits as
when its whole sequence is prefilled alone, whether it is decoded (in a batch of sequences of other
lengths), computed in prefill chunks of any size after a cached prefix, or batched with other
sequences' chunks; with fp8 caches, blocks smaller and larger than its key chunks, grouped-query
heads (3 query rows a decode, padded to 4), head_dim 128 and 96, K and V (and fp8 scales) as separate tensors and
as the halves of one (the runner's layout). The torch backend fails the same checks."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from common.contract.config import WorkerConfig
from worker_service.attention import AttentionBackend, default_backend_name, get_attention_backend
from worker_service.attention.base import AttentionMetadata
from worker_service.attention.kv_quant import FP8_DTYPE, allocate_scales
from worker_service.loader.placement import resolve_weights_and_backend

SEQ_LENS = [1, 63, 64, 65, 150, 203]
# (query heads, KV heads, head_dim, block_size, fp8 cache)
CASES = {
    "gqa3-bs16": (6, 2, 64, 16, False),
    "mha-d128-bs256": (2, 2, 128, 256, False),
    "gqa4-bs32-fp8": (8, 1, 64, 32, True),
    "d96-bs16": (4, 2, 96, 16, False),  # a head_dim chunk of 64 and one of 32
}
STACKED = {"gqa3-bs16", "gqa4-bs32-fp8"}


@dataclass
class Cache:
    """Every sequence's K/V stored in a paged cache, and a q for each of its positions."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    block_tables: list[list[int]]
    queries: list[torch.Tensor]  # [seq_len, heads, head_dim] per sequence
    block_size: int


def metadata(cache: Cache, parts: list[tuple[int, int, int]]) -> AttentionMetadata:
    """A batch of (sequence, first query position, query_len) parts, each seeing positions 0..its last."""
    query_lens = [n for _, _, n in parts]
    seq_lens = [start + n for _, start, n in parts]
    width = max(len(cache.block_tables[s]) for s, _, _ in parts)
    tables = torch.tensor([cache.block_tables[s] + [0] * (width - len(cache.block_tables[s])) for s, _, _ in parts],
                          dtype=torch.int32)
    slots = torch.cat([torch.tensor([cache.block_tables[s][p // cache.block_size] * cache.block_size
                                     + p % cache.block_size for p in range(start, start + n)])
                       for s, start, n in parts])
    starts = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    return AttentionMetadata(slot_mapping=slots, query_start_loc=starts, seq_lens=torch.tensor(seq_lens),
                             block_tables=tables, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
                             block_size=cache.block_size, query_lens_host=query_lens, seq_lens_host=seq_lens)


def make_cache(backend: AttentionBackend, case: str) -> Cache:
    num_heads, num_kv_heads, head_dim, block_size, fp8 = CASES[case]
    generator = torch.Generator().manual_seed(len(case))
    num_blocks = sum(-(-n // block_size) for n in SEQ_LENS) + 3
    dtype = FP8_DTYPE if fp8 else torch.float32
    if case in STACKED:  # as the runner lays a layer out: K and V the halves of one tensor, their scales too
        k, v = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
        scales = list(allocate_scales(torch.zeros, (2, num_blocks), block_size, num_kv_heads, "cpu")) if fp8 \
            else [None, None]
    else:
        k = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
        v = torch.zeros_like(k)
        scales = [allocate_scales(torch.zeros, (num_blocks,), block_size, num_kv_heads, "cpu") if fp8 else None
                  for _ in range(2)]
    order = torch.randperm(num_blocks - 1, generator=generator) + 1  # scattered blocks; 0 stays a padding target
    tables, next_block = [], 0
    for seq_len in SEQ_LENS:
        count = -(-seq_len // block_size)
        tables.append(order[next_block:next_block + count].tolist())
        next_block += count
    cache = Cache(k, v, scales[0], scales[1], tables, [], block_size)
    for seq, seq_len in enumerate(SEQ_LENS):
        keys = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator) * 2
        values = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator)
        backend.store_kv(keys, values, k, v, metadata(cache, [(seq, 0, seq_len)]), scales[0], scales[1])
        cache.queries.append(torch.randn(seq_len, num_heads, head_dim, generator=generator))
    return cache


def attend(backend: AttentionBackend, cache: Cache, parts: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    """The outputs of each part of one batch."""
    q = torch.cat([cache.queries[s][start:start + n] for s, start, n in parts])
    head_dim = q.shape[-1]
    out = backend.attend(q, cache.k, cache.v, metadata(cache, parts), head_dim**-0.5, cache.k_scale, cache.v_scale)
    return list(out.split([n for _, _, n in parts]))


def batches() -> dict[str, list[list[tuple[int, int, int]]]]:
    """Ways to compute every query of every sequence (each a list of batches of parts)."""
    chunked = {}
    for size in (1, 5, 64, 100):
        chunked[f"chunks of {size}"] = [[(s, start, min(size, n - start))] for s, n in enumerate(SEQ_LENS)
                                        for start in range(0, n, size)]
    decode = [[(s, p, 1) for s, n in enumerate(SEQ_LENS) if p < n] for p in range(max(SEQ_LENS))]
    # Every sequence's prefix as one batch of prefill parts, then the rest decoded, other sequences beside.
    mixed = [[(s, 0, n // 2 + 1) for s, n in enumerate(SEQ_LENS)]]
    mixed += [[(s, p, 1) for s, n in enumerate(SEQ_LENS) if n // 2 + 1 <= p < n] for p in range(max(SEQ_LENS))]
    return {**chunked, "decoded together": decode, "prefill batch then decode": [b for b in mixed if b]}


def differences(backend_name: str, case: str) -> list[str]:
    """The ways of computing in which some query's output differs from its sequence's lone prefill."""
    backend = get_attention_backend(backend_name)
    cache = make_cache(backend, case)
    alone = [attend(backend, cache, [(s, 0, n)])[0] for s, n in enumerate(SEQ_LENS)]
    differing = []
    for name, steps in batches().items():
        same = True
        for parts in steps:
            for (seq, start, count), out in zip(parts, attend(backend, cache, parts), strict=True):
                same &= torch.equal(out, alone[seq][start:start + count])
        if not same:
            differing.append(name)
    return differing


@pytest.mark.parametrize("case", list(CASES))
def test_a_querys_output_does_not_depend_on_the_batch(case: str) -> None:
    assert differences("torch-invariant", case) == []


def test_the_torch_backend_fails_the_same_check() -> None:
    assert differences("torch", "gqa3-bs16")


def test_outputs_agree_with_the_torch_backend() -> None:
    """The same attention as the reference backend (not the same bits: another order of sums)."""
    invariant_backend, reference = get_attention_backend("torch-invariant"), get_attention_backend("torch")
    cache = make_cache(reference, "gqa3-bs16")
    for seq, seq_len in enumerate(SEQ_LENS):
        parts = [(seq, 0, seq_len)]
        torch.testing.assert_close(attend(invariant_backend, cache, parts)[0], attend(reference, cache, parts)[0],
                                   rtol=2e-5, atol=2e-6)


def test_deterministic_placement_picks_and_requires_an_invariant_backend(tmp_path) -> None:
    from tests.tiny_models import make_tiny_checkpoint

    path = str(make_tiny_checkpoint(tmp_path, "qwen3"))
    assert default_backend_name(torch.device("cpu"), deterministic=True) == "torch-invariant"
    assert default_backend_name(torch.device("cuda"), deterministic=True) == "triton-invariant"
    cpu = torch.device("cpu")
    _, backend = resolve_weights_and_backend(WorkerConfig(model=path, deterministic=True), cpu)
    assert backend.name == "torch-invariant" and backend.batch_invariant
    _, backend = resolve_weights_and_backend(WorkerConfig(model=path), cpu)
    assert backend.name == "torch" and not backend.batch_invariant
    with pytest.raises(ValueError, match="torch-sdpa is not batch-invariant.*use torch-invariant"):
        resolve_weights_and_backend(WorkerConfig(model=path, deterministic=True, attention_backend="torch-sdpa"), cpu)
    with pytest.raises(ValueError, match="float32"):
        resolve_weights_and_backend(WorkerConfig(model=path, deterministic=True, dtype="bfloat16"), cpu)
