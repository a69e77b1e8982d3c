"""bench/fp8_operand_quality.py's emulation: with no operand rounded it is the torch backend's decode
over an fp8 cache (the same attention as an online softmax over tiles); q's rounding keeps each head's
largest value and puts every value on e4m3's grid times the head's scale; the backend's decode is
restored when the emulation ends."""
from __future__ import annotations

import torch

from bench.fp8_operand_quality import DECODE_TILE, e4m3, fp8_operands, quantized_per_head
from worker_service.attention import torch_backend
from worker_service.attention.base import AttentionMetadata
from worker_service.attention.kv_quant import FP8_DTYPE, FP8_MAX, allocate_scales

BLOCK_SIZE = 16
NUM_KV_HEADS, GROUP, HEAD_DIM = 2, 3, 32
SEQ_LENS = [1, DECODE_TILE, 3 * DECODE_TILE + 5]  # one token, one whole tile, tiles and a partial one


def fp8_cache_with_context(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                 torch.Tensor, torch.Tensor]:
    """An fp8 K/V cache, with its scales, holding SEQ_LENS tokens of random K/V (stored by the torch
    backend, as a worker stores them) and the sequences' block tables."""
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in SEQ_LENS]
    num_blocks = sum(blocks_per_seq)
    k_cache, v_cache = (torch.zeros(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=FP8_DTYPE) for _ in "kv")
    k_scale, v_scale = (allocate_scales(torch.zeros, (num_blocks,), BLOCK_SIZE, NUM_KV_HEADS, torch.device("cpu"))
                        for _ in "kv")
    tables = torch.zeros(len(SEQ_LENS), max(blocks_per_seq), dtype=torch.int32)
    slots, first = [], 0
    for seq, (seq_len, count) in enumerate(zip(SEQ_LENS, blocks_per_seq, strict=True)):
        tables[seq, :count] = torch.arange(first, first + count)
        slots += [(first + position // BLOCK_SIZE) * BLOCK_SIZE + position % BLOCK_SIZE for position in range(seq_len)]
        first += count
    k, v = (torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, generator=generator) * 3 for _ in "kv")
    store = AttentionMetadata(slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor([0, len(slots)]),
                              seq_lens=torch.tensor([len(slots)]), block_tables=tables[:1], max_query_len=len(slots),
                              max_seq_len=len(slots), block_size=BLOCK_SIZE)
    torch_backend.TorchAttentionBackend().store_kv(k, v, k_cache, v_cache, store, k_scale, v_scale)
    return k_cache, v_cache, k_scale, v_scale, tables


def decode(q: torch.Tensor, caches: tuple[torch.Tensor, ...]) -> torch.Tensor:
    k_cache, v_cache, k_scale, v_scale, tables = caches
    num_seqs = len(SEQ_LENS)
    metadata = AttentionMetadata(slot_mapping=torch.zeros(num_seqs, dtype=torch.int64),
                                 query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
                                 seq_lens=torch.tensor(SEQ_LENS, dtype=torch.int32), block_tables=tables,
                                 max_query_len=1, max_seq_len=max(SEQ_LENS), block_size=BLOCK_SIZE)
    return torch_backend.TorchAttentionBackend().attend(q, k_cache, v_cache, metadata, HEAD_DIM ** -0.5,
                                                       k_scale, v_scale)


def test_no_rounded_operand_is_the_backends_decode_and_rounding_q_and_p_changes_it() -> None:
    generator = torch.Generator().manual_seed(0)
    caches = fp8_cache_with_context(generator)
    q = torch.randn(len(SEQ_LENS), NUM_KV_HEADS * GROUP, HEAD_DIM, generator=generator)
    backend = decode(q, caches)
    with fp8_operands("none"):
        same = decode(q, caches)
    with fp8_operands("qp"):
        rounded = decode(q, caches)
    assert decode(q, caches).equal(backend)  # the backend's own decode again
    torch.testing.assert_close(same, backend, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(rounded, backend, rtol=1e-3, atol=1e-3)
    # One context token: every probability is 1 (exact in e4m3), only q's rounding is left, and the
    # output is that token's V whatever the scores.
    torch.testing.assert_close(rounded[0], backend[0], rtol=1e-6, atol=1e-6)


def test_q_rounding_keeps_each_heads_largest_value_and_lands_on_the_e4m3_grid() -> None:
    q = torch.randn(4, 3, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    q[1, 2] = 0.0  # a zero head stays zero
    rounded = quantized_per_head(q)
    top = q.abs().amax(-1, keepdim=True)
    assert rounded.abs().amax(-1, keepdim=True).equal(top)
    on_grid = rounded[top[..., 0] > 0] * (FP8_MAX / top[top > 0][:, None])
    torch.testing.assert_close(e4m3(on_grid), on_grid, rtol=1e-6, atol=0)
    assert rounded[1, 2].eq(0).all()
