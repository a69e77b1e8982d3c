"""A pure-torch attention backend over the paged KV cache: the reference implementation, and the
CPU backend. Loops over sequences on the host, so it is for tests and CPU serving, not for speed."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from worker_service.attention import register_backend
from worker_service.attention.base import AttentionBackend, AttentionMetadata
from worker_service.attention.kv_quant import dequantize, head_scales, is_fp8, quantize


@register_backend("torch")
class TorchAttentionBackend(AttentionBackend):
    """Prefill, chunked prefill with a cached prefix, and decode are one code path: the query tokens
    of a sequence are always the last query_len positions of its seq_len-long context."""

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 metadata: AttentionMetadata, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
        slots = metadata.slot_mapping
        if k.shape[0] != slots.shape[0]:
            raise ValueError(f"{k.shape[0]} new tokens but {slots.shape[0]} slots")
        # Negative slots mark padding tokens (e.g. a padded CUDA graph batch): nothing to store.
        keep = slots >= 0
        if not bool(keep.all()):
            slots, k, v = slots[keep], k[keep], v[keep]
        num_kv_heads, head_dim = k_cache.shape[-2:]
        if not is_fp8(k_cache.dtype):
            k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
            v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))
            return
        for cache, scale_cache, new in ((k_cache, k_scale, k), (v_cache, v_scale, v)):
            scales = head_scales(new)
            # CPU torch cannot index_copy_ float8 tensors; copying the bits as uint8 is the same.
            stored = quantize(new, scales).view(torch.uint8)
            cache.view(torch.uint8).view(-1, num_kv_heads, head_dim).index_copy_(0, slots, stored)
            block_size = cache.shape[1]
            scale_cache[slots // block_size, slots % block_size] = scales  # any layout (kv_quant.allocate_scales)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
               scale: float, k_scale: torch.Tensor | None = None,
               v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """An fp8 cache is read back as float32 (values times their scales), then as any other."""
        if is_fp8(k_cache.dtype):
            k_cache, v_cache = Dequantized(k_cache, k_scale), Dequantized(v_cache, v_scale)
        query_lens, seq_lens = host_lengths(metadata)
        if metadata.max_query_len == 1 and q.shape[0] == len(seq_lens):
            return _batched_decode(q, k_cache, v_cache, metadata, seq_lens, scale)
        out = torch.empty_like(q)
        start = 0
        for seq_index, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
            if query_len == 0:
                continue
            k, v = _gather_context(k_cache, v_cache, metadata.block_tables[seq_index], seq_len, metadata.block_size)
            out[start:start + query_len] = self.causal_attention(q[start:start + query_len], k, v, scale)
            start += query_len
        return out

    @staticmethod
    def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        return _causal_attention(q, k, v, scale)


@register_backend("torch-sdpa")
class TorchSdpaAttentionBackend(TorchAttentionBackend):
    """The torch backend with prefill attention in torch's fused scaled_dot_product_attention (a
    flash kernel on CPUs that never writes the [heads, query, context] scores): at 2,000 tokens
    4.7x faster than the eager formula on 2 cores (87 vs 408 ms a layer of the default model), equal
    within 6e-7. Not bit-identical to transformers' eager attention, so the default only where the
    weights are quantized anyway (`cpu_weight_format` int4); float32 keeps the reference formula."""

    @staticmethod
    def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        return _sdpa_causal_attention(q, k, v, scale)


class Dequantized:
    """An fp8 cache and its scales, read through gather_blocks like the cache itself: the gathered
    blocks only, not the whole cache, are dequantized (to float32)."""

    def __init__(self, cache: torch.Tensor, scales: torch.Tensor) -> None:
        self.cache, self.scales = cache, scales
        self.shape = cache.shape


def host_lengths(metadata: AttentionMetadata) -> tuple[list[int], list[int]]:
    """Query and context lengths per sequence as Python ints (one sync when the host copies are absent)."""
    query_lens = metadata.query_lens_host
    if query_lens is None:
        query_lens = metadata.query_start_loc.diff().tolist()
    seq_lens = metadata.seq_lens_host if metadata.seq_lens_host is not None else metadata.seq_lens.tolist()
    return query_lens, seq_lens


def _gather_context(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                    block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of positions 0..seq_len-1 of one sequence: [seq_len, num_kv_heads, head_dim] each."""
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].long()
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k = gather_blocks(k_cache, blocks).reshape(-1, num_kv_heads, head_dim)[:seq_len]
    v = gather_blocks(v_cache, blocks).reshape(-1, num_kv_heads, head_dim)[:seq_len]
    return k, v


def gather_blocks(cache: torch.Tensor | Dequantized, blocks: torch.Tensor) -> torch.Tensor:
    """cache[blocks] for block ids of any shape, through index_select: on a CPU several times
    faster than indexing with a tensor (the default model's K of one 1,000-token sequence in blocks
    of 16: 156 -> 31 us; done twice a layer a step)."""
    if isinstance(cache, Dequantized):
        # CPU torch cannot index float8 tensors: gather the bits as uint8.
        values = gather_blocks(cache.cache.view(torch.uint8), blocks).view(cache.cache.dtype)
        return dequantize(values, gather_blocks(cache.scales, blocks))
    return torch.index_select(cache, 0, blocks.reshape(-1)).view(*blocks.shape, *cache.shape[1:])


def _batched_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
                    seq_lens: list[int], scale: float) -> torch.Tensor:
    """One query token per sequence, all sequences at once over their contexts padded to the
    longest: a few large operations instead of a few small ones per sequence. On a CPU each op costs
    microseconds of dispatch, as much as its work at decode sizes: so no mask when no context is
    padded (always so for one sequence), and matmuls rather than einsum (the same products, fewer ops)."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[-2]
    max_len = max(seq_lens)
    num_blocks = -(-max_len // metadata.block_size)
    blocks = metadata.block_tables[:, :num_blocks].long()
    k = gather_blocks(k_cache, blocks).reshape(num_seqs, -1, num_kv_heads, head_dim)[:, :max_len].float()
    v = gather_blocks(v_cache, blocks).reshape(num_seqs, -1, num_kv_heads, head_dim)[:, :max_len].float()
    is_padding = None
    if min(seq_lens) < max_len:
        is_padding = torch.arange(max_len, device=q.device)[None, :] >= torch.tensor(seq_lens, device=q.device)[:, None]
        if v.is_cuda:
            # A GPU cache starts uninitialised: padding slots may hold NaN, and 0 * NaN is NaN. (The
            # CPU cache starts zeroed and only ever holds real K/V.)
            v = v.masked_fill(is_padding[:, :, None, None], 0.0)
    # GQA: query head h reads kv head h // group, so the heads split as [kv_head, group].
    grouped = q.float().view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.matmul(grouped, k.permute(0, 2, 3, 1)).mul_(scale)  # [seqs, kv_heads, group, max_len]
    if is_padding is not None:
        scores.masked_fill_(is_padding[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.transpose(1, 2))
    return out.view(num_seqs, num_heads, head_dim).to(q.dtype)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [query_len, num_heads, d] are the last query_len positions of the context k, v [seq_len, num_kv_heads, d].

    Computed as HF's eager attention does (scores, then softmax, then weighted sum), in float32.
    """
    query_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    # GQA: query head h reads kv head h // group, HF's repeat_kv order.
    k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, seq_len, d]
    v = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(q.float().transpose(0, 1), k.transpose(1, 2)) * scale  # [heads, query_len, seq_len]
    query_positions = torch.arange(seq_len - query_len, seq_len, device=q.device)
    is_future = torch.arange(seq_len, device=q.device)[None, :] > query_positions[:, None]
    scores.masked_fill_(is_future, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v).transpose(0, 1).to(q.dtype)  # [query_len, heads, d]


def _sdpa_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """_causal_attention through F.scaled_dot_product_attention. The KV heads are repeated (its
    grouped-query option takes a slower path on CPUs), and a query chunk after a cached prefix gets
    an explicit mask: is_causal aligns the first query with the first key, not with its position."""
    query_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)[None]  # [1, heads, seq_len, d]
    v = v.float().repeat_interleave(group, dim=1).transpose(0, 1)[None]
    mask = None
    if query_len != seq_len:
        query_positions = torch.arange(seq_len - query_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= query_positions[:, None]
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k, v, attn_mask=mask,
                                         is_causal=mask is None, scale=scale)
    return out[0].transpose(0, 1).to(q.dtype)  # [query_len, heads, d]
