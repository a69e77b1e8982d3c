"""The flash-attn backend on a GPU against the float64 reference of test_triton_attention over the
same paged caches: prefill and mixed batches (FlashAttention's kernels, every block size, GQA groups,
head_dim 64 and 128, long chunks over long cached prefixes), and what it leaves to the Triton kernels
(decode-only batches, float32) bit for bit the Triton backend's."""
from __future__ import annotations

import pytest
import torch

from tests.worker_service.triton_runtime import FLASH_ATTN_INSTALLED

if not torch.cuda.is_available() or not FLASH_ATTN_INSTALLED:
    pytest.skip("needs a CUDA device and flash-attn-4", allow_module_level=True)

from tests.worker_service.test_triton_attention import (  # noqa: E402
    PagedBatch,
    assert_matches,
    make_batch,
    prefill_cases,
    random_lengths,
    reference,
)
from worker_service.attention import default_backend_name, get_attention_backend  # noqa: E402

pytestmark = pytest.mark.gpu


class CountingFlash:
    """The backend with its FlashAttention entry point counted."""

    def __init__(self) -> None:
        self.backend = get_attention_backend("flash-attn")
        self.calls = 0
        varlen = self.backend._varlen_attention

        def counted(*args, **kwargs):
            self.calls += 1
            return varlen(*args, **kwargs)

        self.backend._varlen_attention = counted

    def attend(self, batch: PagedBatch) -> torch.Tensor:
        return self.backend.attend(batch.q, batch.k_cache, batch.v_cache, batch.metadata(), batch.q.shape[-1] ** -0.5)


@pytest.mark.parametrize("block_size", [16, 64, 128, 256])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 8])
def test_prefill_matches_reference(block_size: int, head_dim: int, group: int) -> None:
    cases = prefill_cases(block_size)
    batch = make_batch([p + n for p, n in cases], [n for _, n in cases], block_size=block_size,
                       num_heads=2 * group, num_kv_heads=2, head_dim=head_dim, dtype=torch.bfloat16,
                       seed=block_size * head_dim + group)
    flash = CountingFlash()
    out = flash.attend(batch)
    assert flash.calls == 1
    assert_matches(out, reference(batch, head_dim ** -0.5), batch, f"flash bs={block_size} d={head_dim} g={group}")


def test_mixed_batch_with_decode_rows_at_model_shapes() -> None:
    """The issue's varlen case (4,096 + 3,000 + 1,024 + 77 new tokens, two over cached prefixes)
    among 40 decode rows, Qwen3-0.6B's heads (16 q, 8 KV, d 128), 256-token blocks."""
    seq_lens = random_lengths(40, 1, 4096, seed=1)
    query_lens = [1] * 40
    for prefix, chunk in ((0, 4096), (5000, 3000), (0, 1024), (300, 77)):
        seq_lens.insert(len(seq_lens) // 2, prefix + chunk)
        query_lens.insert(len(query_lens) // 2, chunk)
    batch = make_batch(seq_lens, query_lens, block_size=256, num_heads=16, num_kv_heads=8, head_dim=128,
                       dtype=torch.bfloat16, seed=2)
    flash = CountingFlash()
    out = flash.attend(batch)
    assert flash.calls == 1
    assert_matches(out, reference(batch, 128 ** -0.5), batch, "mixed at model shapes")


def test_long_chunk_over_a_long_cached_prefix() -> None:
    batch = make_batch([24576 + 8192], [8192], block_size=256, num_heads=16, num_kv_heads=8, head_dim=128,
                       dtype=torch.bfloat16, seed=3)
    assert_matches(CountingFlash().attend(batch), reference(batch, 128 ** -0.5), batch, "8k chunk over 24k")


@pytest.mark.parametrize(("dtype", "query_lens"), [(torch.bfloat16, [1, 1, 1]), (torch.float32, [1, 30, 7])],
                         ids=["bf16-decode", "float32-prefill"])
def test_what_flash_attention_does_not_take_is_the_triton_backends(dtype: torch.dtype, query_lens: list[int]) -> None:
    batch = make_batch([700, 2000, 33], query_lens, block_size=16, num_heads=8, num_kv_heads=2, head_dim=128,
                       dtype=dtype, seed=4)
    flash = CountingFlash()
    out = flash.attend(batch)
    triton = get_attention_backend("triton").attend(batch.q, batch.k_cache, batch.v_cache, batch.metadata(),
                                                    128 ** -0.5)
    assert flash.calls == 0
    assert torch.equal(out, triton)


@pytest.mark.skipif(torch.cuda.get_device_capability()[0] != 9, reason="not a Hopper GPU")
def test_flash_attn_is_the_default_on_hopper() -> None:
    assert default_backend_name(torch.device("cuda")) == "flash-attn"
    assert default_backend_name(torch.device("cuda"), deterministic=True) == "triton-invariant"
