"""What fp8 tensor-core operands in decode attention would cost in quality, emulated on the CPU.

A decode kernel that feeds Hopper's fp8 tensor cores (wgmma takes e4m3 operands) rounds more than
the fp8 cache already does: q, quantized per query head (scale max|q| / 448), for the scores, and
the probabilities for the PV product, per tile of DECODE_TILE tokens as an online softmax makes them
(each relative to the running max, times its token's V scale over the tile's largest, times
P_SCALE to sit in e4m3's normal range). This runs bench/fp8_kv_quality.py's comparison (the same
text, windows and report: fp8 cache against the unquantized one) with the fp8 run's decode steps
computed that way, in float32 with torch's round-to-nearest-even e4m3 conversions; every position
after a window's first is a decode step unless --num-decode-positions says fewer. The CPU path is
the torch backend; the emulation replaces its batched decode for fp8 caches while it runs.

    python bench/fp8_operand_quality.py --operands qp      # q and P in e4m3
    python bench/fp8_operand_quality.py --operands none    # the fp8 cache alone, the same code path
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import fp8_kv_quality  # noqa: E402
from worker_service.attention import torch_backend  # noqa: E402
from worker_service.attention.base import AttentionMetadata  # noqa: E402
from worker_service.attention.kv_quant import FP8_DTYPE, FP8_MAX  # noqa: E402

DECODE_TILE = 64  # tokens per tile, as the Triton decode kernel's DECODE_BLOCK_N
P_SCALE = 256.0  # probabilities (<= 1) times this before their e4m3 rounding
OPERANDS = ("none", "q", "p", "qp")


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """x rounded to float8 e4m3 (saturated), back in float32."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()


def quantized_per_head(q: torch.Tensor) -> torch.Tensor:
    """q [..., head_dim] through e4m3 with one scale per head vector, max|q| / 448."""
    top = q.abs().amax(-1, keepdim=True)
    top = torch.where(top > 0, top, torch.ones_like(top))
    return e4m3(q * (FP8_MAX / top)) * (top / FP8_MAX)


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v_values: torch.Tensor, v_scales: torch.Tensor, scale: float,
                    round_p: bool) -> torch.Tensor:
    """One sequence's decode attention as an online softmax over DECODE_TILE-token tiles.
    q [kv_heads, group, d]; k [tokens, kv_heads, d] (dequantized); v_values [tokens, kv_heads, d] (e4m3
    values, unscaled) and v_scales [tokens, kv_heads]. round_p: the probabilities times their V scale
    over the tile's largest, times P_SCALE, rounded to e4m3 before the PV product."""
    scores = torch.einsum("hgd,thd->hgt", q, k) * (scale * math.log2(math.e))  # log2 domain, as the kernel
    row_max = torch.full(scores.shape[:2], float("-inf"))
    row_sum = torch.zeros(scores.shape[:2])
    acc = torch.zeros(q.shape)
    for start in range(0, k.shape[0], DECODE_TILE):
        tile = slice(start, start + DECODE_TILE)
        new_max = torch.maximum(row_max, scores[..., tile].amax(-1))
        alpha = torch.exp2(row_max - new_max)
        p = torch.exp2(scores[..., tile] - new_max[..., None])
        row_sum = row_sum * alpha + p.sum(-1)
        tile_scales = v_scales[tile].T  # [kv_heads, tile]
        top = tile_scales.amax(-1, keepdim=True)
        weights = p * (tile_scales / top)[:, None, :]
        if round_p:
            weights = e4m3(weights * P_SCALE) / P_SCALE
        acc = acc * alpha[..., None] + torch.einsum("hgt,thd->hgd", weights, v_values[tile]) * top[..., None]
        row_max = new_max
    return acc / row_sum[..., None]


def emulated_decode(q: torch.Tensor, k_cache: torch.Tensor | torch_backend.Dequantized,
                    v_cache: torch.Tensor | torch_backend.Dequantized, metadata: AttentionMetadata,
                    seq_lens: list[int], scale: float, *, operands: str, fallback: Callable[..., torch.Tensor]
                    ) -> torch.Tensor:
    """The torch backend's batched decode for an fp8 cache, with these operands in e4m3 ("q", "p",
    "qp" or "none"); any other cache goes to fallback (the backend's own)."""
    if not isinstance(k_cache, torch_backend.Dequantized) or not isinstance(v_cache, torch_backend.Dequantized):
        return fallback(q, k_cache, v_cache, metadata, seq_lens, scale)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[-2]
    out = torch.empty(num_seqs, num_heads, head_dim)
    for seq, seq_len in enumerate(seq_lens):
        blocks = metadata.block_tables[seq, :-(-seq_len // metadata.block_size)].long()
        k = torch_backend.gather_blocks(k_cache, blocks).reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v_bits = torch_backend.gather_blocks(v_cache.cache.view(torch.uint8), blocks).view(FP8_DTYPE)
        v_values = v_bits.reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        v_scales = torch_backend.gather_blocks(v_cache.scales, blocks).reshape(-1, num_kv_heads)[:seq_len]
        grouped = q[seq].float().view(num_kv_heads, num_heads // num_kv_heads, head_dim)
        if "q" in operands:
            grouped = quantized_per_head(grouped)
        out[seq] = tiled_attention(grouped, k, v_values, v_scales, scale, "p" in operands).reshape(num_heads, head_dim)
    return out.to(q.dtype)


@contextlib.contextmanager
def fp8_operands(operands: str) -> Iterator[None]:
    """The torch backend's decode over fp8 caches emulates these operands while the block runs."""
    original = torch_backend._batched_decode
    torch_backend._batched_decode = functools.partial(emulated_decode, operands=operands, fallback=original)
    try:
        yield
    finally:
        torch_backend._batched_decode = original


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--operands", choices=OPERANDS, required=True, help="which operands go through e4m3")
    parser.add_argument("--model", help="checkpoint folder or .gguf (default: the default model)")
    parser.add_argument("--num-windows", type=int, default=2)
    parser.add_argument("--window-len", type=int, default=1024)
    parser.add_argument("--num-decode-positions", type=int, help="per window (default: all but the first token)")
    args = parser.parse_args(argv)
    if args.model is None:
        from common.formats.default_model import default_model_path

        args.model = default_model_path()
    num_decode = args.window_len - 1 if args.num_decode_positions is None else args.num_decode_positions
    windows = fp8_kv_quality.text_windows(args.model, args.num_windows, args.window_len)
    print(f"model {args.model}\n{args.num_windows} windows of {args.window_len} tokens, {num_decode} decode "
          f"positions each, e4m3 operands: {args.operands} (tile {DECODE_TILE}, P scale {P_SCALE:g})")
    with fp8_operands(args.operands):
        report = fp8_kv_quality.compare(args.model, windows, "cpu", "auto", 256, num_decode)
    print("\n".join(report.lines()))


if __name__ == "__main__":
    main()
