"""The Triton attention kernels (store_kv, split-K paged decode, paged prefill) and backend against a
float64 reference over the same paged cache.

Runs on a CUDA device. Without one it runs on the CPU through Triton's interpreter when
TRITON_INTERPRET=1 (tests/worker_service/triton_runtime.py sets it where the interpreter works: Triton
installed, numpy < 2.3, as the dev extra pins), at small sizes, in float16 instead of bfloat16 (the
interpreter's bf16 tl.dot is wrong) and float32; otherwise it is skipped before Triton is imported.

Every check draws fresh random inputs (caches included: a read of a wrong slot changes the
result), poisons outputs with NaN first and requires every element written, and reports the worst
sequence and head.
"""
from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from tests.worker_service.triton_runtime import DEVICE, FLASH_ATTN_INSTALLED, INTERPRET, skip_module_unless_kernels_run

skip_module_unless_kernels_run()

from worker_service.attention import default_backend_name, get_attention_backend  # noqa: E402
from worker_service.attention.base import AttentionMetadata, longest_first  # noqa: E402
from worker_service.attention.triton_decode import (  # noqa: E402
    PROGRAMS_PER_SM,
    choose_num_splits,
    decode_counters_numel,
    decode_workspace_numel,
    paged_decode,
)
from worker_service.attention.triton_prefill import paged_prefill  # noqa: E402
from worker_service.attention.triton_store_kv import store_kv  # noqa: E402

pytestmark = pytest.mark.gpu

LOW = torch.float16 if INTERPRET else torch.bfloat16  # the serving dtype (bf16 on the GPU)
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-3}
BLOCK_SIZES = [16, 64] if INTERPRET else [16, 64, 256]
HEAD_DIMS = [32, 64] if INTERPRET else [64, 128]
GROUPS = [1, 2, 4, 8]
NUM_KV_HEADS = 2  # per-test KV heads; Qwen3-0.6B shapes (16 q, 8 kv, 128) get their own tests
MAX_CONTEXT = 200 if INTERPRET else 8192


def small(gpu: int, interpret: int) -> int:
    """A size for the GPU run, or the smaller one for the CPU interpreter."""
    return interpret if INTERPRET else gpu


@dataclass
class PagedBatch:
    """Sequences whose query tokens (packed in q) are the last query_len of seq_len positions, the
    whole context living in a paged cache whose blocks are handed out in random order."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: list[int]
    query_lens: list[int]

    def metadata(self, slot_mapping: torch.Tensor | None = None) -> AttentionMetadata:
        starts = [0]
        for query_len in self.query_lens:
            starts.append(starts[-1] + query_len)
        slots = slot_mapping if slot_mapping is not None else torch.full((starts[-1],), -1, dtype=torch.int64)
        return AttentionMetadata(
            slot_mapping=slots.to(DEVICE),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32, device=DEVICE),
            block_tables=self.block_tables,
            max_query_len=max(self.query_lens),
            max_seq_len=max(self.seq_lens),
            block_size=self.k_cache.shape[1],
            query_lens_host=list(self.query_lens),
            seq_lens_host=list(self.seq_lens),
        )


def make_batch(seq_lens: list[int], query_lens: list[int], *, block_size: int, num_heads: int, num_kv_heads: int,
               head_dim: int, dtype: torch.dtype, seed: int, spare_blocks: int = 3) -> PagedBatch:
    """Random caches (every block, used or not), shuffled block tables padded with 0 and two extra
    columns, and queries of std 2 (peakier softmax than std 1: exercises the running-max rescale)."""
    generator = torch.Generator(DEVICE).manual_seed(seed)  # on the device: caches reach gigabytes
    blocks_per_seq = [max(1, math.ceil(n / block_size)) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator, device=DEVICE).to(dtype)
    v_cache = torch.randn(shape, generator=generator, device=DEVICE).to(dtype)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 2, dtype=torch.int32)
    for row, count in enumerate(blocks_per_seq):
        tables[row, :count] = torch.tensor([order.pop() for _ in range(count)], dtype=torch.int32)
    q = 2 * torch.randn(sum(query_lens), num_heads, head_dim, generator=generator, device=DEVICE)
    return PagedBatch(q.to(dtype), k_cache, v_cache, tables.to(DEVICE), list(seq_lens), list(query_lens))


def reference(batch: PagedBatch, scale: float) -> torch.Tensor:
    """Causal attention in float64, sequence by sequence; rows of sequences with seq_len 0 are 0."""
    q = batch.q.double()
    out = torch.zeros_like(q)
    num_heads, block_size = q.shape[1], batch.k_cache.shape[1]
    group = num_heads // batch.k_cache.shape[2]
    start = 0
    for row, (seq_len, query_len) in enumerate(zip(batch.seq_lens, batch.query_lens, strict=True)):
        if seq_len == 0 or query_len == 0:
            start += query_len
            continue
        blocks = batch.block_tables[row, :math.ceil(seq_len / block_size)].long()
        k = batch.k_cache[blocks].flatten(0, 1)[:seq_len].double().repeat_interleave(group, 1).transpose(0, 1)
        v = batch.v_cache[blocks].flatten(0, 1)[:seq_len].double().repeat_interleave(group, 1).transpose(0, 1)
        for chunk in range(0, query_len, 1024):  # bounds the [heads, queries, keys] score memory
            chunk_len = min(1024, query_len - chunk)
            rows = slice(start + chunk, start + chunk + chunk_len)
            scores = torch.matmul(q[rows].transpose(0, 1), k.transpose(1, 2)) * scale
            positions = torch.arange(seq_len - query_len + chunk, seq_len - query_len + chunk + chunk_len,
                                     device=q.device)
            scores.masked_fill_(torch.arange(seq_len, device=q.device)[None, :] > positions[:, None], float("-inf"))
            out[rows] = torch.matmul(torch.softmax(scores, -1), v).transpose(0, 1)
        start += query_len
    return out


def assert_matches(out: torch.Tensor, ref: torch.Tensor, batch: PagedBatch, what: str) -> None:
    """Every element written (no NaN left from the poison) and ‖out−ref‖/‖ref‖ under the dtype's
    tolerance; on failure names the worst (sequence, head) with its lengths and errors."""
    token_to_seq = torch.repeat_interleave(torch.arange(len(batch.query_lens)), torch.tensor(batch.query_lens))
    unwritten = torch.isnan(out).any(-1).nonzero().tolist()
    assert not unwritten, (f"{what}: {len(unwritten)} (token, head) rows not written or NaN, first "
                           f"(token, head, seq) = {[(t, h, int(token_to_seq[t])) for t, h in unwritten[:5]]}")
    diff = out.double() - ref
    error = (diff.norm() / ref.norm().clamp_min(1e-30)).item()
    tolerance = TOLERANCE[out.dtype]
    if error < tolerance:
        return
    row_error = diff.norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)  # [tokens, heads]
    token, head = divmod(int(row_error.argmax()), row_error.shape[1])
    seq = int(token_to_seq[token])
    raise AssertionError(
        f"{what}: relative error {error:.3e} >= {tolerance:.0e}; max abs error {diff.abs().max().item():.3e}; "
        f"worst: token {token} = seq {seq} (seq_len {batch.seq_lens[seq]}, query_len {batch.query_lens[seq]}), "
        f"head {head}, row relative error {row_error[token, head].item():.3e}")


def random_lengths(count: int, low: int, high: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(count)]


# ---------------------------------------------------------------------------------------------- store_kv


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(1, HEAD_DIMS[0]), (8, HEAD_DIMS[-1]), (3, HEAD_DIMS[-1])])
@pytest.mark.parametrize("dtype", [LOW, torch.float32])
def test_store_kv_writes_exactly_the_given_slots(block_size: int, num_kv_heads: int, head_dim: int,
                                                 dtype: torch.dtype) -> None:
    num_blocks, num_tokens = small(64, 8), small(700, 40)
    generator = torch.Generator().manual_seed(block_size * 7 + num_kv_heads)
    # K and V as non-contiguous views of one fused projection output, as a model produces them.
    qkv = torch.randn(num_tokens, 2 * num_kv_heads + 4, head_dim, generator=generator).to(DEVICE, dtype)
    k, v = qkv[:, 4:4 + num_kv_heads], qkv[:, 4 + num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[torch.rand(num_tokens, generator=generator) < 0.1] = -1  # padding tokens: skipped
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=LOW, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=LOW, device=DEVICE)
    store_kv(k, v, k_cache, v_cache, slots.to(DEVICE))

    keep = slots >= 0
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[keep]] = True
    for name, cache, new in (("k", k_cache, k), ("v", v_cache, v)):
        flat = cache.view(-1, num_kv_heads, head_dim).cpu()
        assert torch.equal(flat[slots[keep]], new[keep.to(DEVICE)].to(LOW).cpu()), f"{name}: wrong values stored"
        assert torch.isnan(flat[~written]).all(), f"{name}: wrote outside the given slots"


# ---------------------------------------------------------------------------------------------- decode


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("splits", ["one", "auto"])
def test_decode_matches_reference(block_size: int, head_dim: int, group: int, splits: str) -> None:
    seq_lens = [1, block_size, block_size + 1, 63, 65, *random_lengths(3, 2, MAX_CONTEXT, seed=group), MAX_CONTEXT]
    batch = make_batch(seq_lens, [1] * len(seq_lens), block_size=block_size, num_heads=NUM_KV_HEADS * group,
                       num_kv_heads=NUM_KV_HEADS, head_dim=head_dim, dtype=LOW, seed=block_size + head_dim + group)
    num_splits = 1 if splits == "one" else choose_num_splits(len(seq_lens), NUM_KV_HEADS, MAX_CONTEXT, DEVICE)
    check_decode(batch, num_splits, f"decode bs={block_size} d={head_dim} group={group} splits={num_splits}")


def check_decode(batch: PagedBatch, num_splits: int, what: str) -> None:
    scale = batch.q.shape[-1] ** -0.5
    out = torch.full_like(batch.q, float("nan"))
    seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int32, device=DEVICE)
    paged_decode(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, seq_lens, scale, num_splits, out=out)
    assert_matches(out, reference(batch, scale), batch, what)


@pytest.mark.parametrize("num_seqs", [1, 3, 64, 256] if not INTERPRET else [1, 3, 8])
@pytest.mark.parametrize("block_size", [16, 256] if not INTERPRET else [16])
def test_decode_batches_at_model_shapes(num_seqs: int, block_size: int) -> None:
    """Qwen3-0.6B shapes (16 query heads, 8 KV heads, head_dim 128), random lengths, auto splits."""
    longest = MAX_CONTEXT if num_seqs <= 3 else small(4096, MAX_CONTEXT)
    seq_lens = random_lengths(num_seqs, 1, longest, seed=num_seqs + block_size)
    heads, kv_heads, head_dim = (16, 8, 128) if not INTERPRET else (4, 2, 64)
    batch = make_batch(seq_lens, [1] * num_seqs, block_size=block_size, num_heads=heads, num_kv_heads=kv_heads,
                       head_dim=head_dim, dtype=LOW, seed=num_seqs)
    num_splits = choose_num_splits(num_seqs, kv_heads, max(seq_lens), DEVICE)
    check_decode(batch, num_splits, f"decode batch={num_seqs} bs={block_size} splits={num_splits}")


def test_num_splits_fill_the_device_only_when_needed() -> None:
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count if DEVICE.type == "cuda" else 132
    assert choose_num_splits(256, 8, 4096, DEVICE) == 1
    assert choose_num_splits(64, 8, 4096, DEVICE) <= 2
    assert choose_num_splits(1, 8, 100, DEVICE) == 1  # too short to be worth splitting
    few_long = choose_num_splits(1, 8, 8192, DEVICE)
    assert few_long * 8 >= sms and few_long <= 64
    # Split programs fill the device once and never start a second wave (triton_decode.PROGRAMS_PER_SM).
    for num_seqs in (1, 2, 3, 4, 8, 16, 32):
        programs = num_seqs * 8 * choose_num_splits(num_seqs, 8, 40960, DEVICE)
        assert programs <= max(PROGRAMS_PER_SM * sms, num_seqs * 8), num_seqs
        assert programs > PROGRAMS_PER_SM * sms // 2 or programs == num_seqs * 8, num_seqs


@pytest.mark.parametrize("num_splits", [1, 2, 5, 64])
def test_decode_split_edges(num_splits: int) -> None:
    """More splits than tiles (empty splits), lengths at tile edges, and seq_len 0 (CUDA graph padding
    rows: output 0, no NaN)."""
    seq_lens = [0, 1, 2, 64, 65, 127, 129, small(3000, 190), 0]
    batch = make_batch(seq_lens, [1] * len(seq_lens), block_size=16, num_heads=8, num_kv_heads=2,
                       head_dim=HEAD_DIMS[-1], dtype=LOW, seed=num_splits)
    check_decode(batch, num_splits, f"decode splits={num_splits}")


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_program_order_changes_no_bit(num_splits: int) -> None:
    """Programs started longest first (the worker's order) or in any other order give the batch-order
    result bit for bit: each sequence's programs compute the same thing wherever they run."""
    seq_lens = [5, small(3000, 190), 0, 64, 17, small(1500, 100), 1]
    batch = make_batch(seq_lens, [1] * len(seq_lens), block_size=16, num_heads=4, num_kv_heads=2,
                       head_dim=HEAD_DIMS[-1], dtype=LOW, seed=num_splits)
    lengths = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    outputs = []
    shuffled = np.random.default_rng(num_splits).permutation(len(seq_lens))
    for order in (None, longest_first(np.array(seq_lens)), shuffled):
        out = torch.full_like(batch.q, float("nan"))
        paged_decode(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, lengths, 0.125, num_splits, out=out,
                     order=None if order is None else torch.tensor(order, dtype=torch.int32, device=DEVICE))
        outputs.append(out)
    assert_matches(outputs[0], reference(batch, 0.125), batch, f"decode splits={num_splits}")
    for out in outputs[1:]:
        assert torch.equal(out, outputs[0])


def test_decode_programs_compute_the_sequences_their_order_names() -> None:
    """The kernel reads the order (one split): program rows that all name sequence 1 compute it alone."""
    seq_lens = [5, 40, 17]
    batch = make_batch(seq_lens, [1] * 3, block_size=16, num_heads=4, num_kv_heads=2, head_dim=64, dtype=LOW,
                       seed=3)
    lengths = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    outputs = []
    for order in (None, torch.ones(3, dtype=torch.int32, device=DEVICE)):
        out = torch.full_like(batch.q, float("nan"))
        paged_decode(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, lengths, 0.125, 1, out=out, order=order)
        outputs.append(out)
    assert torch.equal(outputs[1][1], outputs[0][1])
    assert outputs[1][[0, 2]].isnan().all()


def test_decode_order_must_be_a_batch_long_int32_tensor() -> None:
    batch = make_batch([3, 4], [1, 1], block_size=16, num_heads=2, num_kv_heads=2, head_dim=64, dtype=LOW, seed=0)
    lengths = torch.tensor([3, 4], dtype=torch.int32, device=DEVICE)
    for order in (torch.tensor([0], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int64)):
        with pytest.raises(ValueError, match="order must be int32"):
            paged_decode(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, lengths, 0.1, 1,
                         order=order.to(DEVICE))


def test_longest_first_is_a_stable_permutation_by_length() -> None:
    order = longest_first(np.array([3, 9, 0, 9, 5], dtype=np.int32))
    assert order.dtype == np.int32
    assert order.tolist() == [1, 3, 4, 0, 2]


@pytest.mark.parametrize("group", [1, 4])
def test_decode_float32(group: int) -> None:
    seq_lens = [1, 33, small(5000, 150), 17]
    batch = make_batch(seq_lens, [1] * 4, block_size=16, num_heads=2 * group, num_kv_heads=2,
                       head_dim=HEAD_DIMS[-1], dtype=torch.float32, seed=group)
    for num_splits in (1, 3):
        check_decode(batch, num_splits, f"decode float32 group={group} splits={num_splits}")


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need a CUDA device")
def test_decode_step_replays_in_a_cuda_graph() -> None:
    """store_kv + decode attend through the backend, captured once with fixed splits and workspace,
    replayed with new queries, new K/V, new slots, lengths and block tables in the same tensors."""
    num_seqs, heads, kv_heads, head_dim, block_size, max_model_len = 8, 16, 8, 128, 16, 8192
    backend = get_attention_backend("triton")
    num_splits = choose_num_splits(num_seqs, kv_heads, max_model_len, DEVICE)
    workspace = torch.empty(decode_workspace_numel(num_seqs, heads, head_dim, num_splits), device=DEVICE)
    counters = torch.zeros(decode_counters_numel(num_seqs, kv_heads, num_splits), dtype=torch.int32, device=DEVICE)
    num_blocks = num_seqs * max_model_len // block_size
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, device=DEVICE, dtype=LOW)
    v_cache = torch.randn(shape, device=DEVICE, dtype=LOW)
    static = {
        "q": torch.randn(num_seqs, heads, head_dim, device=DEVICE, dtype=LOW),
        "k": torch.randn(num_seqs, kv_heads, head_dim, device=DEVICE, dtype=LOW),
        "v": torch.randn(num_seqs, kv_heads, head_dim, device=DEVICE, dtype=LOW),
        "slots": torch.zeros(num_seqs, dtype=torch.int64, device=DEVICE),
        "seq_lens": torch.ones(num_seqs, dtype=torch.int32, device=DEVICE),
        "tables": torch.zeros(num_seqs, max_model_len // block_size + 2, dtype=torch.int32, device=DEVICE),
    }
    metadata = AttentionMetadata(
        slot_mapping=static["slots"], query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=DEVICE),
        seq_lens=static["seq_lens"], block_tables=static["tables"], max_query_len=1, max_seq_len=max_model_len,
        block_size=block_size, decode_num_splits=num_splits, decode_workspace=workspace,
        decode_counters=counters)
    scale = head_dim ** -0.5

    def step() -> torch.Tensor:
        backend.store_kv(static["k"], static["v"], k_cache, v_cache, metadata)
        return backend.attend(static["q"], k_cache, v_cache, metadata, scale)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step()

    for replay in range(3):
        seq_lens = random_lengths(num_seqs, 1, max_model_len, seed=100 + replay)
        seq_lens[-1] = 0 if replay == 2 else seq_lens[-1]  # a padding row in the last replay
        batch = make_batch(seq_lens, [1] * num_seqs, block_size=block_size, num_heads=heads, num_kv_heads=kv_heads,
                           head_dim=head_dim, dtype=LOW, seed=200 + replay, spare_blocks=0)
        batch.k_cache, batch.v_cache = k_cache, v_cache  # the graph's cache, refilled with fresh values
        k_cache.normal_()
        v_cache.normal_()
        last = [max(n, 1) - 1 for n in seq_lens]
        slots = [int(batch.block_tables[i, p // block_size]) * block_size + p % block_size for i, p in enumerate(last)]
        slots = [s if n > 0 else -1 for s, n in zip(slots, seq_lens, strict=True)]
        static["q"].copy_(batch.q)
        static["k"].normal_()
        static["v"].normal_()
        static["slots"].copy_(torch.tensor(slots))
        static["seq_lens"].copy_(torch.tensor(seq_lens))
        static["tables"].zero_()
        static["tables"][:, :batch.block_tables.shape[1]].copy_(batch.block_tables)
        graph_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        flat_k = k_cache.view(-1, kv_heads, head_dim)
        stored = [i for i, s in enumerate(slots) if s >= 0]
        assert torch.equal(flat_k[torch.tensor([slots[i] for i in stored])], static["k"][stored]), "store_kv in graph"
        assert_matches(graph_out, reference(batch, scale), batch, f"graph replay {replay}")


# ---------------------------------------------------------------------------------------------- prefill


def prefill_cases(block_size: int) -> list[tuple[int, int]]:
    """(cached prefix length, query length) pairs: plain prefill, block-aligned and unaligned cached
    prefixes, chunks ending mid-block, and decode rows mixed in."""
    cases = [(0, 1), (0, 17), (0, small(300, 70)), (2 * block_size, small(100, 30)), (37, small(77, 20)),
             (small(100, 40), 1), (5, 1), (small(1000, 90), small(64, 9)), (0, 2 * block_size + 3)]
    if not INTERPRET:
        cases += [(0, 1024), (3000, 500)]
    return cases


def check_prefill(batch: PagedBatch, what: str) -> None:
    scale = batch.q.shape[-1] ** -0.5
    metadata = batch.metadata()
    out = torch.full_like(batch.q, float("nan"))
    paged_prefill(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, metadata.seq_lens,
                  metadata.query_start_loc, metadata.max_query_len, scale, out=out)
    assert_matches(out, reference(batch, scale), batch, what)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("group", GROUPS)
def test_prefill_matches_reference(block_size: int, head_dim: int, group: int) -> None:
    cases = prefill_cases(block_size)
    batch = make_batch([p + n for p, n in cases], [n for _, n in cases], block_size=block_size,
                       num_heads=NUM_KV_HEADS * group, num_kv_heads=NUM_KV_HEADS, head_dim=head_dim, dtype=LOW,
                       seed=block_size * head_dim + group)
    check_prefill(batch, f"prefill bs={block_size} d={head_dim} group={group}")


@pytest.mark.parametrize("group", [1, 3, 8] if not INTERPRET else [3])
def test_prefill_mixed_with_many_decode_rows(group: int) -> None:
    """A mixed batch as chunked prefill schedules it: decode rows of random lengths around two
    prefill chunks (one with a cached prefix); a small max_query_len picks a small query tile."""
    num_decodes = small(60, 6)
    seq_lens = random_lengths(num_decodes, 1, small(4096, 150), seed=group)
    query_lens = [1] * num_decodes
    for prefix, chunk in ((0, small(200, 20)), (small(1500, 50), small(37, 5))):
        seq_lens.insert(len(seq_lens) // 2, prefix + chunk)
        query_lens.insert(len(query_lens) // 2, chunk)
    batch = make_batch(seq_lens, query_lens, block_size=16, num_heads=2 * group, num_kv_heads=2,
                       head_dim=HEAD_DIMS[-1], dtype=LOW, seed=group)
    check_prefill(batch, f"mixed group={group}")
    short = make_batch([9, 3, 40, 2], [2, 3, 1, 2], block_size=16, num_heads=2 * group, num_kv_heads=2,
                       head_dim=HEAD_DIMS[-1], dtype=LOW, seed=group + 1)
    check_prefill(short, f"short queries group={group}")


@pytest.mark.skipif(INTERPRET, reason="too large for the interpreter")
def test_prefill_long_context_at_model_shapes() -> None:
    for prefix, chunk in ((0, 8192), (6000, 2192)):
        batch = make_batch([prefix + chunk], [chunk], block_size=256, num_heads=16, num_kv_heads=8, head_dim=128,
                           dtype=LOW, seed=prefix)
        check_prefill(batch, f"long prefill prefix={prefix} chunk={chunk}")


def test_prefill_float32() -> None:
    cases = [(0, small(150, 40)), (small(70, 20), small(33, 9)), (small(200, 50), 1)]
    batch = make_batch([p + n for p, n in cases], [n for _, n in cases], block_size=16, num_heads=4,
                       num_kv_heads=2, head_dim=HEAD_DIMS[-1], dtype=torch.float32, seed=5)
    check_prefill(batch, "prefill float32")


# ---------------------------------------------------------------------------------------------- backend


@pytest.mark.skipif(FLASH_ATTN_INSTALLED, reason="flash-attn-4 installed: its default is in test_gpu_flash_attn.py")
def test_triton_is_the_cuda_default_without_flash_attn() -> None:
    assert default_backend_name(torch.device("cuda")) == "triton"
    assert get_attention_backend("triton").name == "triton"


@pytest.mark.parametrize("block_size", [16, 64])
def test_backend_chunked_prefill_then_decode_matches_torch_backend(block_size: int) -> None:
    """Two sequences go through the backends' store_kv + attend step by step: one prefills in chunks
    (the second chunk over its cached first one) while the other prefills whole, then both decode.
    Each step's K/V goes through slot_mapping into shuffled blocks (a padding slot -1 included), and
    the Triton backend's caches must match the torch backend's bit for bit."""
    heads, kv_heads, head_dim = 4, 2, HEAD_DIMS[-1]
    lengths = [small(700, 60), small(333, 35)]
    num_blocks = sum(math.ceil((n + 4) / block_size) for n in lengths) + 2
    generator = torch.Generator().manual_seed(block_size)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = [[order.pop() for _ in range(math.ceil((n + 4) / block_size))] for n in lengths]
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    caches = {name: (torch.randn(shape, generator=generator).to(DEVICE, LOW),
                     torch.randn(shape, generator=generator).to(DEVICE, LOW)) for name in ("torch", "triton")}
    caches["torch"] = (caches["triton"][0].clone(), caches["triton"][1].clone())
    first_chunk = lengths[0] // 2
    steps = [[(0, 0, first_chunk), (1, 0, lengths[1])], [(0, first_chunk, lengths[0])]]
    steps += [[(0, lengths[0] + i, lengths[0] + i + 1), (1, lengths[1] + i, lengths[1] + i + 1)] for i in range(3)]
    for step_index, step in enumerate(steps):
        slots, starts = [], [0]
        for seq, begin, end in step:
            slots += [tables[seq][p // block_size] * block_size + p % block_size for p in range(begin, end)]
            starts.append(starts[-1] + end - begin)
        slots.append(-1)  # one padding token at the end, as a padded CUDA graph batch has
        num_tokens = len(slots)
        batch_tables = block_tables[[seq for seq, _, _ in step]]
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor([end for _, _, end in step], dtype=torch.int32, device=DEVICE),
            block_tables=batch_tables, max_query_len=max(e - b for _, b, e in step),
            max_seq_len=max(e for _, _, e in step), block_size=block_size)
        q = torch.randn(num_tokens, heads, head_dim, generator=generator).to(DEVICE, LOW)
        k = torch.randn(num_tokens, kv_heads, head_dim, generator=generator).to(DEVICE, LOW)
        v = torch.randn(num_tokens, kv_heads, head_dim, generator=generator).to(DEVICE, LOW)
        outputs = {}
        for name in ("torch", "triton"):
            backend = get_attention_backend(name)
            backend.store_kv(k, v, *caches[name], metadata)
            trimmed = dataclasses.replace(metadata, slot_mapping=metadata.slot_mapping[:-1])
            outputs[name] = backend.attend(q[:-1], *caches[name], trimmed, head_dim ** -0.5)
        assert torch.equal(caches["torch"][0], caches["triton"][0]), f"step {step_index}: K caches differ"
        assert torch.equal(caches["torch"][1], caches["triton"][1]), f"step {step_index}: V caches differ"
        view = PagedBatch(q[:-1], *caches["triton"], batch_tables, [e for _, _, e in step], [e - b for _, b, e in step])
        ref = reference(view, head_dim ** -0.5)
        assert_matches(outputs["torch"], ref, view, f"torch backend step {step_index}")  # the test's own sanity
        assert_matches(outputs["triton"], ref, view, f"triton backend step {step_index}")
