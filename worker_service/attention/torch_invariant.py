"""A batch-invariant CPU attention backend ("torch-invariant", the CPU's under --deterministic): the output
of a query at position p is a function of its q and of keys and values 0..p alone. It is the same bits
whether the query is a decode token, in a prefill chunk of any size, after a cached prefix, or batched
with other sequences of other lengths.

The torch backend is not: its products and softmax run over the whole context (or the batch's longest,
padded), and MKL and torch's reductions order their sums by the shapes. Here:

- scores are products of query rows (at least MIN_ROWS: the grouped heads of each token, padded) and
  keys (any number of them) over HEAD_CHUNK columns of head_dim at a time, added in order;
- keys after a query's position (later ones, and the padding of the context to whole chunks) are
  masked to -inf, so their probabilities are exact zeros, and a row's max is exact in any order;
- the probabilities meet V in chunks of CHUNK absolute positions (chunk j holds positions CHUNK j ..):
  one product of inner size CHUNK per chunk, and a column of ones appended to V gives the softmax's
  denominator from the same products as the numerators; the chunks' partials are added by cumsum over
  the chunks: one after another, in double, so the chunks past a query's own, all zeros, leave its sum
  as it is. A prefill block therefore reads only the chunks up to its last query, and a decode batch
  pads every sequence to the longest: neither changes a row.

These are the shapes cpu_products found row-invariant (a product's row, or column, is the same bits
for any number of rows from MIN_ROWS up, and any number of columns); the tests assert it for these
products too. Prefill loops over sequences; decode-only batches run at once, in about a dozen ops
(a CPU decode step is bound by per-op dispatch). fp8 caches are read back as the torch backend reads them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from worker_service.attention import register_backend
from worker_service.attention.base import AttentionMetadata
from worker_service.attention.kv_quant import FP8_DTYPE, dequantize, is_fp8
from worker_service.attention.torch_backend import TorchAttentionBackend, host_lengths

CHUNK = 64  # key positions per chunk of the value product, aligned to absolute positions
HEAD_CHUNK = 64  # columns of head_dim per score product (128 gave some rows other bits at other row counts)
MIN_ROWS = 4  # query rows per product at least (fewer change MKL's kernel; see invariant/cpu_products)
MAX_SCORES = 1 << 22  # floats of scores per call: a long prefill chunk runs in blocks of queries


@register_backend("torch-invariant")
class TorchInvariantAttentionBackend(TorchAttentionBackend):
    """store_kv as the torch backend's; attend in the fixed order of the module docstring."""

    batch_invariant = True

    def __init__(self) -> None:
        # Every layer of a step attends with the same shapes: these keep, from call to call, what never
        # changes in them (V's column of ones, the query padding's zeros), and the allocations; and a
        # decode step's plan, made at its first layer.
        self._context = _Reused(1.0)
        self._rows = _Reused(0.0)
        self._decode: tuple[AttentionMetadata, _Plan] | None = None

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
               scale: float, k_scale: torch.Tensor | None = None,
               v_scale: torch.Tensor | None = None) -> torch.Tensor:
        caches = _CachePair(k_cache, v_cache, k_scale, v_scale)
        query_lens, seq_lens = host_lengths(metadata)
        if metadata.max_query_len == 1 and q.shape[0] == len(seq_lens):  # decode only: all sequences at once
            if self._decode is None or self._decode[0] is not metadata:
                self._decode = metadata, _Plan.make(metadata.block_tables, [[n - 1] for n in seq_lens],
                                                    metadata.block_size)
            return self._attention(q[:, None], caches, self._decode[1], scale)[:, 0]
        out = torch.empty_like(q)
        block = max(1, MAX_SCORES // (max(seq_lens) * q.shape[1]))  # queries whose scores fit MAX_SCORES
        start = 0
        for seq_index, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
            first_position = seq_len - query_len
            for first in range(0, query_len, block):  # each block over the keys up to its last query
                last = min(first + block, query_len)
                plan = _Plan.make(metadata.block_tables[seq_index:seq_index + 1],
                                  [list(range(first_position + first, first_position + last))], metadata.block_size)
                out[start + first:start + last] = self._attention(q[None, start + first:start + last], caches, plan,
                                                                  scale)[0]
            start += query_len
        return out

    def _attention(self, q: torch.Tensor, caches: _CachePair, plan: _Plan, scale: float) -> torch.Tensor:
        """Queries q [seqs, tokens, heads, d] at the plan's positions: [seqs, tokens, heads, d] in q's dtype.
        Every product is a torch.bmm of 3D operands in the same layouts whatever the batch (torch.matmul
        copies some operands, and not others)."""
        num_seqs, num_tokens, num_heads, head_dim = q.shape
        stored = caches.gather(plan.blocks).narrow(2, 0, plan.num_stored)  # [2, seqs, positions, kv heads, d]
        num_kv_heads = stored.shape[3]
        num_keys = plan.num_chunks * CHUNK
        # K and V of positions 0 .. num_keys - 1, V's last column ones (K's unused). Positions past the
        # stored ones keep what they held (finite: ones, or earlier K and V), after every query: masked.
        context = self._context.get((2, num_seqs, num_kv_heads, num_keys, head_dim + 1), q.device)
        context.narrow(3, 0, plan.num_stored).narrow(4, 0, head_dim).copy_(stored.transpose(2, 3))
        group = num_heads // num_kv_heads
        padded_group = max(group, -(-MIN_ROWS // num_tokens))  # rows per KV head: tokens x padded group
        num_rows, batch = num_tokens * padded_group, num_seqs * num_kv_heads
        rows = self._rows.get((num_seqs, num_kv_heads, num_tokens, padded_group, head_dim), q.device)
        torch.mul(q.view(num_seqs, num_tokens, num_kv_heads, group, head_dim).transpose(1, 2), scale,
                  out=rows.narrow(3, 0, group))
        keys, values = context.view(2, batch, num_keys, head_dim + 1)
        scores = _scores(rows.view(batch, num_rows, head_dim), keys)  # [batch, rows, keys]
        plan.mask(scores.view(num_seqs, num_kv_heads, num_tokens, padded_group, num_keys))
        weights = scores.new_empty((batch, plan.num_chunks, num_rows, CHUNK))  # the value product's layout
        torch.exp(scores.sub_(scores.amax(dim=-1, keepdim=True)).view(batch, num_rows, plan.num_chunks, CHUNK),
                  out=weights.transpose(1, 2))
        partials = torch.bmm(weights.view(-1, num_rows, CHUNK), values.view(-1, CHUNK, head_dim + 1))
        sums = partials.view(batch, plan.num_chunks, num_rows, head_dim + 1).cumsum(1).select(1, -1)
        sums = sums.view(num_seqs, num_kv_heads, num_tokens, padded_group, head_dim + 1).narrow(3, 0, group)
        out = q.new_empty((num_seqs, num_tokens, num_kv_heads, group, head_dim))
        torch.div(sums.narrow(-1, 0, head_dim), sums.narrow(-1, head_dim, 1), out=out.transpose(1, 2))
        return out.view(num_seqs, num_tokens, num_heads, head_dim)


@dataclass(frozen=True)
class _Plan:
    """What attending at given query positions needs besides the layer's own tensors (so a decode step
    makes it once for all its layers): the blocks to read, how many of their positions to keep, the
    chunks that cover the longest sequence, and where the masked keys are."""

    blocks: torch.Tensor  # [seqs, blocks] ids of the blocks that hold the longest sequence
    num_stored: int  # their positions kept (at most num_chunks * CHUNK)
    num_chunks: int
    first_masked: int | None  # one query: its keys from here on are masked
    is_future: torch.Tensor | None  # else [seqs, 1, tokens, 1, keys]: the keys after each query's position

    @staticmethod
    def make(block_tables: torch.Tensor, positions: list[list[int]], block_size: int) -> _Plan:
        """positions: of the queries, per sequence (of block_tables' rows), per token."""
        num_positions = max(max(row) for row in positions) + 1
        num_chunks = -(-num_positions // CHUNK)
        blocks = block_tables[:, :-(-num_positions // block_size)]
        num_stored = min(blocks.shape[1] * block_size, num_chunks * CHUNK)
        if len(positions) == 1 and len(positions[0]) == 1:
            return _Plan(blocks, num_stored, num_chunks, positions[0][0] + 1, None)
        query_positions = torch.tensor(positions, device=block_tables.device)  # [seqs, tokens]
        is_future = torch.arange(num_chunks * CHUNK, device=block_tables.device) > query_positions[:, :, None]
        return _Plan(blocks, num_stored, num_chunks, None, is_future[:, None, :, None, :])

    def mask(self, scores: torch.Tensor) -> None:
        """-inf, in place, at the masked keys of scores [seqs, kv heads, tokens, group, keys]."""
        if self.first_masked is not None:
            scores.narrow(-1, self.first_masked, scores.shape[-1] - self.first_masked).fill_(float("-inf"))
        else:
            assert self.is_future is not None
            scores.masked_fill_(self.is_future, float("-inf"))


class _CachePair:
    """A layer's K and V caches (and an fp8 cache's scales), read together: by one index_select when they
    are the two halves of one tensor, as the runner allocates them (kv_cache.KVCacheSpec.allocate)."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                 v_scale: torch.Tensor | None) -> None:
        self.is_fp8 = is_fp8(k_cache.dtype)
        if self.is_fp8:  # CPU torch cannot index float8 tensors: their bits as uint8
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        self.caches = _stacked(k_cache, v_cache)
        self.scales = _stacked(k_scale, v_scale) if self.is_fp8 else None

    def gather(self, blocks: torch.Tensor) -> torch.Tensor:
        """The blocks [seqs, n] of both caches: [2, seqs, n * block_size, kv heads, d], fp8 dequantized."""
        index = blocks.reshape(-1)
        values = _select(self.caches, index)  # [2, seqs * n, block_size, kv heads, d]
        if self.is_fp8:
            assert self.scales is not None
            values = dequantize(values.view(FP8_DTYPE), _select(self.scales, index))
        return values.view(2, blocks.shape[0], -1, *values.shape[-2:])


def _stacked(first: torch.Tensor | None, second: torch.Tensor | None) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """[2, ...] as a view when second lies at a fixed distance after first in the same storage with the
    same shape and strides; else the pair as it is."""
    assert first is not None and second is not None
    distance = second.data_ptr() - first.data_ptr()
    if (first.shape == second.shape and first.stride() == second.stride() and first.dtype == second.dtype
            and first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
            and distance > 0 and distance % first.element_size() == 0):
        return first.as_strided((2, *first.shape), (distance // first.element_size(), *first.stride()))
    return first, second


def _select(pair: torch.Tensor | tuple[torch.Tensor, ...], index: torch.Tensor) -> torch.Tensor:
    """pair[:, index] of a stacked pair, or of a pair of tensors (then stacked)."""
    if isinstance(pair, torch.Tensor):
        return torch.index_select(pair, 1, index)
    return torch.stack([torch.index_select(tensor, 0, index) for tensor in pair])


class _Reused:
    """A float32 tensor kept from call to call while its shape stays the same; made filled with `fill`."""

    def __init__(self, fill: float) -> None:
        self.fill = fill
        self.tensor: torch.Tensor | None = None

    def get(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        tensor = self.tensor
        if tensor is None or tuple(tensor.shape) != shape or tensor.device != device:
            self.tensor = tensor = torch.full(shape, self.fill, device=device)
        return tensor


def _scores(rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """rows [batch, rows, d] . keys [batch, keys, d + 1 (the last column unused)] -> [batch, rows, keys]:
    products over HEAD_CHUNK columns of d at a time, added in order."""
    head_dim = rows.shape[-1]
    total = None
    for start in range(0, head_dim, HEAD_CHUNK):
        stop = min(start + HEAD_CHUNK, head_dim)
        part = torch.bmm(rows[..., start:stop], keys[..., start:stop].transpose(1, 2))
        total = part if total is None else total.add_(part)
    assert total is not None
    return total
