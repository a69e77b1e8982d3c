"""Times the Triton attention kernels on a CUDA device at Qwen3-0.6B shapes (16 query heads, 8 KV
heads, head_dim 128, bf16), against torch SDPA on contiguous tensors holding the same K/V.

    python bench/attention_bench.py            # decode grid + prefill, then a summary table
    python bench/attention_bench.py --sweep    # also sweeps kernel tile sizes, warps, stages, splits
    python bench/attention_bench.py --decode-sweep 256:1024   # only the decode sweep, at these shapes
    python bench/attention_bench.py --kv-cache-dtype fp8 --decode-only   # decode over an FP8 cache
    python bench/attention_bench.py --random-lengths 256 64   # sequences of 100-2047 tokens, bf16 and fp8
    python bench/attention_bench.py --decode-shapes 1:32768   # only the decode rows at these shapes

Decode: batch sizes 1, 8, 64, 256 x contexts 512, 1024, 4096 (every sequence at that context),
block sizes 256 and 16; reports the achieved K+V read bandwidth (bytes of K and V read / median time)
and its fraction of the device-to-device copy bandwidth of the device it runs on, measured first
(bench/throughput.measure_copy_bandwidth: 4.3 TB/s on an H200; issue 31's kernel criterion). Prefill: 256
sequences of 1024 new tokens each, causal, in TFLOP/s. Times are triton.testing.do_bench medians
(it flushes the L2 before each run, so the K/V really come from HBM). Each Triton result is first
checked against SDPA's output, so a broken kernel cannot post a number. With --kv-cache-dtype fp8 the
decode kernel reads an e4m3 cache with its per-vector scales (kv_quant), SDPA the dequantized K/V,
and the bytes counted are the fp8 values plus their float32 scales. The invariant-dec and invariant-pre
rows time what `--deterministic` runs instead (attention/triton_invariant: the prefill kernel for decode
batches too, every tile through the masked path). Where flash-attn-4 is installed, flash-* rows time
FlashAttention over the same paged cache (the flash-attn backend's prefill; its decode for comparison).
"""
from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.throughput import measure_copy_bandwidth  # noqa: E402
from worker_service.attention.base import longest_first  # noqa: E402
from worker_service.attention.flash_attn_backend import as_pages, load_varlen_attention, page_tables  # noqa: E402
from worker_service.attention.kv_quant import allocate_scales, dequantize, head_scales, quantize  # noqa: E402
from worker_service.attention.triton_decode import (  # noqa: E402
    DECODE_BLOCK_N,
    DECODE_NUM_STAGES,
    MAX_NUM_SPLITS,
    choose_num_splits,
    decode_num_warps,
    new_decode_scratch,
    paged_decode,
)
from worker_service.attention.triton_prefill import paged_prefill  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128
DTYPE = torch.bfloat16
SCALE = HEAD_DIM ** -0.5


@dataclass
class Row:
    what: str
    block_size: int | str
    batch: int
    context: int
    splits: int | str
    time_us: float
    rate: float  # GB/s for decode, TFLOP/s for prefill
    unit: str
    error: float  # ‖triton − sdpa‖ / ‖sdpa‖ (nan for the SDPA rows)

    def line(self, copy_gbs: float | None = None) -> str:
        """The row under HEADER; a decode row's rate also as a share of copy_gbs (the device's copy, GB/s)."""
        share = f"{self.rate / copy_gbs:7.1%}" if self.unit == "GB/s" and copy_gbs else " " * 7
        return (f"{self.what:<14} {self.block_size!s:>5} {self.batch:>5} {self.context:>6} {self.splits!s:>6} "
                f"{self.time_us:>10.1f} {self.rate:>9.1f} {self.unit:<7} {share} {self.error:>9.1e}")


HEADER = (f"{'kernel':<14} {'block':>5} {'batch':>5} {'ctx':>6} {'splits':>6} {'time_us':>10} {'rate':>9} "
          f"{'unit':<7} {'of copy':>7} {'rel_err':>9}")


def bench_ms(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def paged_copy(k: torch.Tensor, v: torch.Tensor, block_size: int) -> tuple[torch.Tensor, ...]:
    """K/V [batch, ctx, kv_heads, d] scattered into a paged cache whose blocks are in random order;
    returns k_cache, v_cache, block_tables."""
    batch, context = k.shape[:2]
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = batch * blocks_per_seq
    order = torch.randperm(num_blocks, device=k.device)
    tables = order.view(batch, blocks_per_seq).to(torch.int32)
    padded = blocks_per_seq * block_size
    caches = []
    for source in (k, v):
        cache = torch.empty(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=k.device)
        blocks = F.pad(source, (0, 0, 0, 0, 0, padded - context)).view(batch * blocks_per_seq, block_size,
                                                                        NUM_KV_HEADS, HEAD_DIM)
        cache[order] = blocks
        caches.append(cache)
    return caches[0], caches[1], tables


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> Callable[[], torch.Tensor]:
    """q [b, heads, n, d], k/v [b, kv_heads, ctx, d]: flash SDPA with GQA, else whatever torch picks
    on K/V repeated to all heads (the name of the path taken is in the returned function's doc)."""
    def flash() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=SCALE, enable_gqa=True)

    try:
        flash()
        flash.__doc__ = "flash"
        return flash
    except RuntimeError:
        group = q.shape[1] // k.shape[1]
        k_all, v_all = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)

        def repeated() -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k_all, v_all, is_causal=is_causal, scale=SCALE)

        repeated.__doc__ = "repeated-kv"
        return repeated


def fp8_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
               context: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """e4m3 copies of paged K and V caches, their scales (paged_decode's k_scale, v_scale, laid out as the
    worker allocates them), and the dequantized K and V of each sequence, [batch, context, kv_heads,
    head_dim], that SDPA should see."""
    flat = tables.long().flatten()
    num_blocks, block_size = k_cache.shape[:2]
    values, scales, seen = [], {}, []
    for name, cache in (("k", k_cache), ("v", v_cache)):
        cache_scales = head_scales(cache)
        values.append(quantize(cache, cache_scales))
        scales[f"{name}_scale"] = allocate_scales(torch.empty, (num_blocks,), block_size, NUM_KV_HEADS,
                                                  cache.device).copy_(cache_scales)
        per_seq = dequantize(values[-1], cache_scales).to(DTYPE)[flat]
        seen.append(per_seq.view(tables.shape[0], -1, NUM_KV_HEADS, HEAD_DIM)[:, :context])
    return values[0], values[1], scales, seen[0], seen[1]


def flash_or_none(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                  seq_lens: torch.Tensor, starts: torch.Tensor,
                  max_query_len: int) -> Callable[[], torch.Tensor] | None:
    """FlashAttention (flash-attn-4) over the same paged cache, as the flash-attn backend calls it;
    None where the package is not installed."""
    try:
        varlen = load_varlen_attention()
    except ValueError:
        return None
    pages_k, pages_v = as_pages(k_cache), as_pages(v_cache)
    table = page_tables(tables, k_cache.shape[1]).contiguous()

    def flash() -> torch.Tensor:
        out = varlen(q, pages_k, pages_v, cu_seqlens_q=starts, max_seqlen_q=max_query_len, seqused_k=seq_lens,
                     page_table=table, softmax_scale=SCALE, causal=True)
        return out[0] if isinstance(out, tuple) else out

    return flash


def decode_rows(block_size: int, batch: int, context: int, device: torch.device, fp8: bool = False) -> list[Row]:
    k = torch.randn(batch, context, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    v = torch.randn_like(k)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    k_cache, v_cache, tables = paged_copy(k, v, block_size)
    scales: dict[str, torch.Tensor] = {}
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * k.element_size()
    if fp8:
        k_cache, v_cache, scales, k, v = fp8_caches(k_cache, v_cache, tables, context)
        kv_bytes = 2 * batch * context * NUM_KV_HEADS * (HEAD_DIM + 4)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    splits = choose_num_splits(batch, NUM_KV_HEADS, context, device)
    workspace, counters = new_decode_scratch(batch, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, splits, device)
    out = torch.empty_like(q)

    def run() -> torch.Tensor:
        return paged_decode(q, k_cache, v_cache, tables, seq_lens, SCALE, splits, workspace, out, counters=counters,
                            **scales)

    starts = torch.arange(batch + 1, dtype=torch.int32, device=device)

    def run_invariant() -> torch.Tensor:  # --deterministic's decode: the prefill kernel, every tile masked
        return paged_prefill(q, k_cache, v_cache, tables, seq_lens, starts, 1, SCALE, out, one_pass=True, **scales)

    reference = sdpa(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), is_causal=False)
    expected = reference()[:, :, 0]
    cases = [("triton-dec-fp8" if fp8 else "triton-decode", run, splits, relative_error(run(), expected)),
             ("invariant-dec", run_invariant, 1, relative_error(run_invariant(), expected))]
    flash = None if fp8 else flash_or_none(q, k_cache, v_cache, tables, seq_lens, starts, 1)
    if flash is not None:
        cases.append(("flash-decode", flash, 1, relative_error(flash(), expected)))
    rows = []
    for what, fn, split_label, err in (*cases, (f"sdpa-{reference.__doc__}", reference, "-", float("nan"))):
        ms = bench_ms(fn)
        rows.append(Row(what, block_size if fn is not reference else "-", batch, context, split_label, ms * 1e3,
                        kv_bytes / ms / 1e6, "GB/s", err))
    return rows


def random_length_rows(device: torch.device, num_seqs: int = 256, lengths: tuple[int, int] = (100, 2047),
                       block_size: int = 256, seed: int = 0, sweep: bool = False, resident_blocks: int = 0,
                       copy_gbs: float | None = None) -> None:
    """Decode at the reference workload's spread of contexts (num_seqs sequences of uniformly random
    lengths): the bf16 cache (also through flash-attn where installed) and an fp8 cache, each kernel with
    its programs in batch order and longest first (the order the worker passes). sweep: also the fp8
    kernel's tile lengths, warps and stages. Prints each row as it is measured (a sweep is long). Bytes:
    each sequence's own K and V (fp8: values and scales); the error is against SDPA with each sequence's
    padding masked, computed once per cache. resident_blocks > 0: every sequence's blocks alias the first
    resident_blocks pages (the same bytes per sequence, now in L2): what the kernel costs when memory is
    not what bounds it, e.g. 16 pages (16 MB of bf16 K/V) on an H100 stand in for a faster memory; the
    outputs then differ from the reference (rel_err nan). copy_gbs: the device's copy bandwidth (GB/s) that
    each row's rate is also given as a share of."""
    generator = torch.Generator().manual_seed(seed)
    seq_lens_list = torch.randint(lengths[0], lengths[1] + 1, (num_seqs,), generator=generator)
    context = int(seq_lens_list.max())
    k = torch.randn(num_seqs, context, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    v = torch.randn_like(k)
    q = torch.randn(num_seqs, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    k_cache, v_cache, tables = paged_copy(k, v, block_size)
    seq_lens = seq_lens_list.to(torch.int32).to(device)
    order = torch.from_numpy(longest_first(seq_lens_list.numpy())).to(device)
    mask = (torch.arange(context, device=device)[None, :] < seq_lens[:, None].long())[:, None, None, :]
    splits = choose_num_splits(num_seqs, NUM_KV_HEADS, context, device)
    workspace, counters = new_decode_scratch(num_seqs, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, splits, device)
    out = torch.empty_like(q)
    tokens = int(seq_lens_list.sum())
    fp8_k, fp8_v, scales, k_seen, v_seen = fp8_caches(k_cache, v_cache, tables, context)
    if resident_blocks:
        tables = tables % resident_blocks
    starts = torch.arange(num_seqs + 1, dtype=torch.int32, device=device)  # one query token per sequence
    caches = {"bf16": (k_cache, v_cache, {}, k, v, 2 * HEAD_DIM * 2),
              "fp8": (fp8_k, fp8_v, scales, k_seen, v_seen, 2 * (HEAD_DIM + 4))}
    configs = {"bf16": [("bf16", {})], "fp8": [("fp8", {})]}
    if sweep:
        configs["fp8"] += [(f"fp8-n{n}-w{w}-s{st}", {"block_n": n, "num_warps": w, "num_stages": st})
                           for n in (32, 64, 128) for w in (1, 2, 4) for st in (2, 3, 4)]
    for kind, (keys, values, scale_args, k_ref, v_ref, bytes_per_head) in caches.items():
        reference = None if resident_blocks else F.scaled_dot_product_attention(
            q[:, :, None], k_ref.transpose(1, 2), v_ref.transpose(1, 2), attn_mask=mask, scale=SCALE,
            enable_gqa=True)[:, :, 0]
        runs = []
        for name, config in configs[kind]:
            for label, program_order in (("", None), ("-lf", order)):
                def run(keys=keys, values=values, scale_args=scale_args, config=config,
                        program_order=program_order) -> torch.Tensor:
                    return paged_decode(q, keys, values, tables, seq_lens, SCALE, splits, workspace, out,
                                        counters=counters, order=program_order, **scale_args, **config)

                runs.append((f"rand-{name}{label}{'-res' if resident_blocks else ''}", run, splits, bool(config)))
        flash = flash_or_none(q, keys, values, tables, seq_lens, starts, 1) if kind == "bf16" and not resident_blocks \
            else None
        if flash is not None:
            runs.append(("rand-flash-bf16", flash, 1, False))
        for what, fn, split_label, swept in runs:
            try:
                error = relative_error(fn(), reference) if reference is not None else float("nan")
                with torch.cuda.nvtx.range(what):  # a profiler's filter, e.g. ncu --nvtx-include rand-fp8-lf/
                    ms = bench_ms(fn)
            except Exception as failure:  # a swept configuration the compiler rejects: report it, go on
                if not swept:
                    raise
                print(f"{what}: FAILED {failure!r:.200}", flush=True)
                continue
            print(Row(what, block_size, num_seqs, context, split_label, ms * 1e3,
                      tokens * NUM_KV_HEADS * bytes_per_head / ms / 1e6, "GB/s", error).line(copy_gbs), flush=True)


def prefill_rows(num_seqs: int, query_len: int, block_size: int, device: torch.device,
                 **config: int) -> list[Row]:
    k = torch.randn(num_seqs, query_len, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    v = torch.randn_like(k)
    q = torch.randn(num_seqs, query_len, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    k_cache, v_cache, tables = paged_copy(k, v, block_size)
    seq_lens = torch.full((num_seqs,), query_len, dtype=torch.int32, device=device)
    starts = torch.arange(0, (num_seqs + 1) * query_len, query_len, dtype=torch.int32, device=device)
    packed_q = q.flatten(0, 1)
    out = torch.empty_like(packed_q)

    def run() -> torch.Tensor:
        return paged_prefill(packed_q, k_cache, v_cache, tables, seq_lens, starts, query_len, SCALE, out, **config)

    def run_one_pass() -> torch.Tensor:  # --deterministic's prefill
        return paged_prefill(packed_q, k_cache, v_cache, tables, seq_lens, starts, query_len, SCALE, out,
                             one_pass=True, **config)

    reference = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    expected = reference().transpose(1, 2).flatten(0, 1)
    # Causal: each head computes QK^T and PV over query_len * (query_len + 1) / 2 (query, key) pairs.
    flops = 4 * num_seqs * NUM_HEADS * HEAD_DIM * query_len * (query_len + 1) / 2
    short = {"max_block_m": "m", "block_n": "n", "num_warps": "w", "num_stages": "s"}
    label = "triton-prefill" if not config else "prefill " + ",".join(f"{short[name]}{value}"
                                                                      for name, value in config.items())
    rows = []
    cases = [(label, run, relative_error(run(), expected))]
    if not config:  # a sweep times its configuration alone
        cases.append(("invariant-pre", run_one_pass, relative_error(run_one_pass(), expected)))
        flash = flash_or_none(packed_q, k_cache, v_cache, tables, seq_lens, starts, query_len)
        if flash is not None:
            cases.append(("flash-prefill", flash, relative_error(flash(), expected)))
        cases.append((f"sdpa-{reference.__doc__}", reference, float("nan")))
    for what, fn, err in cases:
        ms = bench_ms(fn)
        rows.append(Row(what, block_size if fn is not reference else "-", num_seqs, query_len, "-", ms * 1e3,
                        flops / ms / 1e9, "TFLOP/s", err))
    return rows


def sweep_decode(block_size: int, batch: int, context: int, device: torch.device, fp8: bool = False) -> list[str]:
    """Splits at the default tile config, then tile configs (block_n, warps, stages) at the chosen
    splits, for one decode shape. The chosen number of splits is marked with '*'. With fp8, the
    error of each against the dequantized K/V."""
    k_cache = torch.randn(batch * context // block_size, block_size, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE,
                          device=device)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(k_cache.shape[0], device=device).view(batch, -1).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    kv_bytes = 2 * k_cache.numel() * k_cache.element_size()
    scales: dict[str, torch.Tensor] = {}
    if fp8:
        k_cache, v_cache, scales, k_seen, v_seen = fp8_caches(k_cache, v_cache, tables, context)
        kv_bytes = kv_bytes // 2 + 2 * scales["k_scale"].numel() * 4
        reference = sdpa(q[:, :, None], k_seen.transpose(1, 2), v_seen.transpose(1, 2), False)()[:, :, 0]
    chosen = choose_num_splits(batch, NUM_KV_HEADS, context, device)
    configs = [(splits, DECODE_BLOCK_N, decode_num_warps(fp8), DECODE_NUM_STAGES)
               for splits in sorted({1, 2, 4, 8, 16, 32, MAX_NUM_SPLITS, chosen})]
    workspace, counters = new_decode_scratch(batch, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, MAX_NUM_SPLITS, device)
    configs += [(chosen, block_n, num_warps, num_stages) for block_n in (32, 64, 128) for num_warps in (1, 2, 4, 8)
                for num_stages in (1, 2, 3, 4)]
    lines = []
    for splits, block_n, num_warps, num_stages in configs:
        def run(s: int = splits, n: int = block_n, w: int = num_warps, st: int = num_stages) -> torch.Tensor:
            return paged_decode(q, k_cache, v_cache, tables, seq_lens, SCALE, s, workspace, counters=counters,
                                block_n=n, num_warps=w, num_stages=st, **scales)

        name = (f"decode{'-fp8' if fp8 else ''} bs={block_size:>3} b={batch:>3} ctx={context} splits={splits:>2}"
                f"{'*' if splits == chosen else ' '} n={block_n:>3} w={num_warps} st={num_stages}")
        try:
            error = f" err {relative_error(run(), reference):.1e}" if fp8 else ""
            ms = bench_ms(run)
            lines.append(f"{name}: {ms * 1e3:8.1f} us {kv_bytes / ms / 1e6:7.0f} GB/s{error}")
        except Exception as error:  # a configuration the compiler rejects: report it, go on
            lines.append(f"{name}: FAILED {error!r:.100}")
        print(lines[-1], flush=True)
    return lines


def sweep(device: torch.device) -> list[str]:
    """Decode and prefill kernel configurations around the defaults."""
    lines = []
    for block_size, batch, context in ((16, 64, 4096), (256, 64, 4096), (256, 8, 4096), (256, 256, 1024)):
        lines += sweep_decode(block_size, batch, context, device)
        torch.cuda.empty_cache()
    for max_block_m in (64, 128):
        for block_n in (32, 64, 128):
            for num_warps in (4, 8):
                for num_stages in (2, 3, 4):
                    config = {"max_block_m": max_block_m, "block_n": block_n, "num_warps": num_warps,
                              "num_stages": num_stages}
                    try:
                        lines.append(prefill_rows(256, 1024, 256, device, **config)[0].line())
                    except Exception as error:  # a configuration the compiler rejects: report it, go on
                        lines.append(f"prefill {config}: FAILED {error!r:.100}")
                    print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="also sweep kernel configurations")
    parser.add_argument("--decode-sweep", metavar="BATCH:CONTEXT", nargs="+",
                        help="only sweep the decode kernel's configurations at these shapes (block size 256)")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                        help="the decode rows' cache: the model dtype (bf16) or e4m3 with scales")
    parser.add_argument("--decode-only", action="store_true", help="skip the prefill rows")
    parser.add_argument("--decode-shapes", metavar="BATCH:CONTEXT", nargs="+",
                        help="only the decode rows at these shapes (block size 256), e.g. 1:32768")
    parser.add_argument("--random-lengths", metavar="NUM_SEQS", type=int, nargs="*",
                        help="only batches of random lengths 100-2047 (default 256 sequences), bf16 and fp8 caches; "
                             "with --sweep also the fp8 kernel's tiles, warps and stages")
    parser.add_argument("--resident", metavar="BLOCKS", type=int, default=0,
                        help="with --random-lengths: every sequence's pages alias the first BLOCKS pages, which stay "
                             "in L2 (the kernel's cost when memory does not bound it)")
    args = parser.parse_args()
    if args.resident < 0:
        parser.error(f"--resident: must be >= 0 pages, got {args.resident}")
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    device = torch.device("cuda")
    torch.manual_seed(0)
    copy_gbs = measure_copy_bandwidth() / 1e9
    torch.cuda.empty_cache()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; device copy "
          f"{copy_gbs / 1e3:.2f} TB/s (read + write)", flush=True)
    if args.decode_sweep:
        for shape in args.decode_sweep:
            batch, context = (int(part) for part in shape.split(":"))
            sweep_decode(256, batch, context, device, args.kv_cache_dtype == "fp8")
        return
    print(HEADER, flush=True)
    if args.decode_shapes:
        for shape in args.decode_shapes:
            batch, context = (int(part) for part in shape.split(":"))
            for row in decode_rows(256, batch, context, device, args.kv_cache_dtype == "fp8"):
                print(row.line(copy_gbs), flush=True)
        return
    if args.random_lengths is not None:
        for num_seqs in args.random_lengths or [256]:
            random_length_rows(device, num_seqs, sweep=args.sweep, resident_blocks=args.resident,
                               copy_gbs=copy_gbs)
        return
    rows: list[Row] = []
    for block_size in (256, 16):
        for batch in (1, 8, 64, 256):
            for context in (512, 1024, 4096):
                for row in decode_rows(block_size, batch, context, device, args.kv_cache_dtype == "fp8"):
                    rows.append(row)
                    print(row.line(copy_gbs), flush=True)
                torch.cuda.empty_cache()
    for block_size in () if args.decode_only else (256, 16):
        for row in prefill_rows(256, 1024, block_size, device):
            rows.append(row)
            print(row.line(copy_gbs), flush=True)
    sweep_lines = sweep(device) if args.sweep else []
    bad = [row for row in rows if not math.isnan(row.error) and not row.error < 2e-2]
    print("\n== summary (K+V bytes / median time for decode; causal FLOPs / median time for prefill) ==")
    print(HEADER)
    for row in rows:
        print(row.line(copy_gbs))
    if sweep_lines:
        print(f"== sweep: {len(sweep_lines)} configurations above; defaults marked by the summary rows ==")
    if bad:
        print(f"WARNING: {len(bad)} Triton results differ from SDPA by >= 2e-2: "
              f"{[(r.what, r.block_size, r.batch, r.context) for r in bad]}")


if __name__ == "__main__":
    main()
