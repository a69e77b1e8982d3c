"""The flash-attn attention backend (`--attention-backend flash-attn`): FlashAttention's CuTe DSL
kernels (the `flash-attn-4` package, `pip install 'nanovllm-grpc[flash-attn]'`) for the attention of
prefill batches over the paged cache, the Triton backend for everything else (see FlashAttnBackend).

FlashAttention reads the cache through a page table; a page whose size is its key tile (128 tokens
at head_dim 128 on Hopper) loads by TMA, one copy per tile, so blocks of 256 tokens are handed to it as
pairs of 128-token pages (page_tables).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from worker_service.attention import register_backend
from worker_service.attention.base import AttentionMetadata
from worker_service.attention.triton_backend import TritonAttentionBackend

FLASH_PAGE_SIZE = 128  # FlashAttention's key tile at head_dim 128 on Hopper: pages of this size load by TMA
FLASH_DTYPES = (torch.float16, torch.bfloat16)
INSTALL_HINT = ("pip install 'nanovllm-grpc[flash-attn]' (flash-attn-4[cu13], FlashAttention's CuTe DSL "
                "kernels for Hopper and Blackwell GPUs), or use --attention-backend triton")


def load_varlen_attention() -> Callable[..., object]:
    """flash_attn.cute.flash_attn_varlen_func; a ValueError (a configuration error: one line at the
    command line) that says how to install it when the package is missing."""
    try:
        module = importlib.import_module("flash_attn.cute")
    except ImportError as error:
        raise ValueError(f"attention_backend: flash-attn needs the flash-attn-4 package ({error}); "
                         f"{INSTALL_HINT}") from error
    return module.flash_attn_varlen_func


def page_tables(block_tables: torch.Tensor, block_size: int, page_size: int = FLASH_PAGE_SIZE) -> torch.Tensor:
    """block_tables [num_seqs, max_blocks] as a table of page_size-token pages: block b is pages
    b * f .. b * f + f - 1 for f = block_size // page_size (the cache viewed as [num_blocks * f,
    page_size, ...]). Unchanged when blocks are not a multiple of page_size."""
    factor = block_size // page_size
    if factor <= 1 or block_size % page_size:
        return block_tables
    offsets = torch.arange(factor, dtype=block_tables.dtype, device=block_tables.device)
    return (block_tables.unsqueeze(-1) * factor + offsets).flatten(1)


def as_pages(cache: torch.Tensor, page_size: int = FLASH_PAGE_SIZE) -> torch.Tensor:
    """cache [num_blocks, block_size, heads, dim] viewed as pages of page_size tokens (see page_tables)."""
    num_blocks, block_size = cache.shape[:2]
    if block_size <= page_size or block_size % page_size:
        return cache
    return cache.view(num_blocks * (block_size // page_size), page_size, *cache.shape[2:])


@register_backend("flash-attn")
class FlashAttnBackend(TritonAttentionBackend):
    """FlashAttention for the attention of prefill and mixed batches in fp16/bf16 over a cache in the
    model dtype, run eagerly; the Triton kernels for the rest: decode-only batches (the split-K
    decode kernel: FlashAttention's Hopper forward has no KV splits, so one sequence would occupy
    num_kv_heads multiprocessors), an fp8 cache (its Hopper forward takes none), float32 (it has no
    float32 kernels), the q/k norms, rotary and the K/V store, and prefills inside a CUDA graph
    capture (whose replays must not depend on a host-side launcher).

    The cache must hold finite values in every slot: FlashAttention's TMA loads read a partly used
    page's rows past the sequence, and a masked score times a NaN value is NaN (kv_cache zeroes it).
    """

    def __init__(self) -> None:
        super().__init__()
        self._varlen_attention = load_varlen_attention()
        # The page table of the last metadata seen: every layer of one forward pass shares it.
        self._pages_of: tuple[AttentionMetadata, torch.Tensor] | None = None

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
               scale: float, k_scale: torch.Tensor | None = None,
               v_scale: torch.Tensor | None = None) -> torch.Tensor:
        if not self.runs_flash(q, k_cache, metadata):
            return super().attend(q, k_cache, v_cache, metadata, scale, k_scale, v_scale)
        result = self._varlen_attention(
            q, as_pages(k_cache), as_pages(v_cache), cu_seqlens_q=metadata.query_start_loc,
            max_seqlen_q=metadata.max_query_len, seqused_k=metadata.seq_lens,
            page_table=self._page_table(metadata), softmax_scale=scale, causal=True)
        return result[0] if isinstance(result, tuple) else result

    def runs_flash(self, q: torch.Tensor, k_cache: torch.Tensor, metadata: AttentionMetadata) -> bool:
        """Whether this call goes to FlashAttention (see the class's docstring for the others)."""
        return (not metadata.is_decode_only and q.is_cuda and q.dtype in FLASH_DTYPES and k_cache.dtype == q.dtype
                and not torch.cuda.is_current_stream_capturing())

    def _page_table(self, metadata: AttentionMetadata) -> torch.Tensor:
        if self._pages_of is None or self._pages_of[0] is not metadata:
            self._pages_of = (metadata, page_tables(metadata.block_tables, metadata.block_size).contiguous())
        return self._pages_of[1]
