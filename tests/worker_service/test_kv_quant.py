"""The FP8 KV cache on the CPU: the number format (kv_quant), the config and CLI option, the pool
holding twice the blocks per byte, and the torch backend storing fp8 and attending over it as over
the dequantized cache. Token-exact parity tests elsewhere keep the default (unquantized) cache."""
from __future__ import annotations

import pytest
import torch

from common.contract.config import WorkerConfig
from worker_service.attention import get_attention_backend
from worker_service.attention.base import AttentionMetadata
from worker_service.attention.kv_quant import (
    FP8_DTYPE,
    allocate_scales,
    dequantize,
    head_scales,
    kv_cache_torch_dtype,
    quantize,
)
from worker_service.runtime.kv_cache import KVCacheSpec


def test_each_head_vector_gets_its_own_scale() -> None:
    x = torch.tensor([[[448.0, -1.0, 0.3], [0.0, 0.0, 0.0]], [[-2.0, 1.0, 0.5], [1e-3, -4e-3, 0.0]]])
    scales = head_scales(x)
    expected = torch.tensor([[448.0, 0.0], [2.0, 4e-3]]) / 448
    expected[0, 1] = 1.0  # an all-zero vector
    assert torch.equal(scales, expected)
    stored = quantize(x, scales)
    assert stored.dtype == FP8_DTYPE
    # The largest magnitude of each vector is stored exactly as +-448; zeros stay zero.
    assert stored.float().abs().amax(-1).tolist() == [[448.0, 0.0], [448.0, 448.0]]
    restored = dequantize(stored, scales)
    assert restored[0, 0].tolist() == [448.0, -1.0, 0.3125]
    torch.testing.assert_close(restored, x, rtol=2**-4, atol=0)


def test_kv_cache_dtype_option() -> None:
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) == FP8_DTYPE
    assert WorkerConfig(model="m", kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        WorkerConfig(model="m", kv_cache_dtype="int8")


def test_fp8_block_holds_about_half_the_bytes_of_bf16() -> None:
    """Qwen3-0.6B's shapes: 128 bytes of fp8 plus a 4-byte scale per head vector, against 256."""
    bf16 = KVCacheSpec(28, 256, 8, 128, torch.bfloat16)
    fp8 = KVCacheSpec(28, 256, 8, 128, FP8_DTYPE)
    assert bf16.bytes_per_block == 28 * 256 * 8 * 128 * 2 * 2
    assert fp8.bytes_per_block == 28 * 256 * 8 * (128 + 4) * 2
    assert bf16.bytes_per_block / fp8.bytes_per_block > 1.93


def test_one_heads_scales_of_consecutive_tokens_are_adjacent() -> None:
    """The decode kernel reads one head's scales for a tile of tokens: one coalesced read."""
    scales = allocate_scales(torch.zeros, (3, 5), 16, 4, "cpu")
    assert scales.shape == (3, 5, 16, 4)
    assert scales.stride()[-2:] == (1, 16)


def test_torch_backend_over_fp8_is_attention_over_the_dequantized_cache() -> None:
    """Two sequences (a chunk over a cached prefix, and a one-token decode) store K/V into an fp8
    cache; attention equals the same backend's over a float32 cache holding the dequantized values."""
    backend = get_attention_backend("torch")
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, block_size, num_blocks = 4, 2, 32, 16, 8
    seq_lens, query_lens = [40, 21], [9, 1]
    tables = torch.tensor([[3, 5, 0], [6, 1, 0]], dtype=torch.int32)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k8, v8 = torch.zeros(shape, dtype=FP8_DTYPE), torch.zeros(shape, dtype=FP8_DTYPE)
    k_scale, v_scale = (allocate_scales(torch.zeros, (num_blocks,), block_size, kv_heads, "cpu") for _ in range(2))
    # The whole context is written through store_kv, as prefill steps would have.
    slots = torch.cat([torch.tensor([int(tables[s, p // block_size]) * block_size + p % block_size
                                     for p in range(n)]) for s, n in enumerate(seq_lens)])
    k = 5 * torch.randn(len(slots), kv_heads, head_dim, generator=generator)
    v = 0.1 * torch.randn(len(slots), kv_heads, head_dim, generator=generator)
    metadata = AttentionMetadata(slot_mapping=slots, query_start_loc=torch.tensor([0, 9, 10], dtype=torch.int32),
                                 seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
                                 max_query_len=9, max_seq_len=40, block_size=block_size,
                                 query_lens_host=query_lens, seq_lens_host=seq_lens)
    backend.store_kv(k, v, k8, v8, metadata, k_scale, v_scale)
    stored = k8.view(torch.uint8).view(-1, kv_heads, head_dim)[slots]
    assert torch.equal(stored, quantize(k, head_scales(k)).view(torch.uint8))
    assert torch.equal(k_scale.reshape(-1, kv_heads)[slots], head_scales(k))
    k32, v32 = dequantize(k8, k_scale), dequantize(v8, v_scale)
    q = torch.randn(10, heads, head_dim, generator=generator)
    decode = AttentionMetadata(slot_mapping=slots[:2], query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
                               seq_lens=metadata.seq_lens, block_tables=tables, max_query_len=1, max_seq_len=40,
                               block_size=block_size, query_lens_host=[1, 1], seq_lens_host=seq_lens)
    for md, qq in ((metadata, q), (decode, q[[8, 9]])):  # the per-sequence path and the batched decode path
        got = backend.attend(qq, k8, v8, md, head_dim**-0.5, k_scale, v_scale)
        want = backend.attend(qq, k32, v32, md, head_dim**-0.5)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_cli_flag_reaches_the_worker_config_and_serve_forwards_it() -> None:
    from common.contract.config import ObservabilityConfig
    from launch.cli import build_parser, worker_config
    from launch.serve import worker_command

    args = build_parser().parse_args(["serve", "--model", "m.gguf", "--kv-cache-dtype", "fp8"])
    assert worker_config(args).kv_cache_dtype == "fp8"
    command = worker_command(worker_config(args), ObservabilityConfig(), 1234)
    assert command[command.index("--kv-cache-dtype") + 1] == "fp8"
    worker = build_parser().parse_args(["worker", "--model", "m.gguf"])
    assert worker_config(worker).kv_cache_dtype == "auto"


def test_model_runner_serves_from_an_fp8_cache(tmp_path) -> None:
    """End to end on the CPU: the runner allocates the fp8 cache and its scales, hands each layer
    its views, and teacher-forced predictions (prefill chunks, then decode steps) track the
    unquantized cache's (the measure of bench/fp8_kv_quality.py, at a tiny size)."""
    import random

    from bench.fp8_kv_quality import compare, make_runner
    from tests.tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path, "qwen3", num_heads=4, num_kv_heads=2, head_dim=32, hidden_size=128,
                                tie=True, seed=7)
    runner = make_runner(str(path), "cpu", "float32", "fp8", 4, 64)
    assert runner.kv_cache.dtype == FP8_DTYPE and runner.kv_scales.shape == (2, 2, 4, 16, 2)
    layer = runner.model.attention_layers()[1]
    assert layer.k_scale.data_ptr() == runner.kv_scales[1, 0].data_ptr()
    rng = random.Random(0)
    windows = [[rng.randrange(512) for _ in range(60)] for _ in range(2)]
    report = compare(str(path), windows, device="cpu", dtype="float32", chunk_len=16, num_decode_positions=8,
                     reference_dtype="float32")
    assert report.num_positions == 118
    assert report.top1_agreement >= 0.95, report.lines()
    # The reference run is the auto run's twin here (float32, unquantized cache): the same predictions.
    assert report.reference_agreement == {"auto": 1.0, "fp8": report.top1_agreement}
    assert "top-1 agreement with the float32 reference: auto 1.0000" in report.lines()[-1]
