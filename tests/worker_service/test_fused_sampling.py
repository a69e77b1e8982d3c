"""The fused Gumbel-max sampling kernel (worker_service.sampling.fused_sampling) and the sampler's use of it.

Runs on a CUDA device. Without one the module is skipped before Triton is imported, unless
TRITON_INTERPRET=1 is set: then it runs on the CPU through Triton's interpreter at small sizes
(the interpreter needs numpy < 2.3: see tests/worker_service/triton_runtime.py, which sets
TRITON_INTERPRET where it works).

The interpreter runs each program in Python (~20 ms a tile), far too slow for the hundreds of
thousands of draws that pin down a distribution. So the statistics are checked twice: through
gumbel_sample itself, with many draws on a GPU and a few in the interpreter, and through a test
kernel that runs the same noise code on many draws per program, everywhere.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

from tests.worker_service.triton_runtime import DEVICE, INTERPRET, skip_module_unless_kernels_run

skip_module_unless_kernels_run()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from common.contract.sampling_params import SamplingParams  # noqa: E402
from worker_service.layers.fused_kernels import num_sms  # noqa: E402
from worker_service.sampling.fused_sampling import (  # noqa: E402
    BLOCK,
    INTERPRETER_NUM_SMS,
    REDUCE_BLOCK,
    _gumbel_log2,
    default_num_chunks,
    gumbel_best,
    gumbel_sample,
)
from worker_service.sampling.sampler import Sampler  # noqa: E402
from worker_service.sampling.sampling_state import SamplingBatch, SamplingRows  # noqa: E402
from worker_service.sampling.vocab_parallel import pick_best  # noqa: E402

pytestmark = pytest.mark.gpu

FAST_LOG = [False] if INTERPRET else [False, True]  # the kernel uses lg2.approx on CUDA
P = SamplingParams
LOG2E = 1.4426950408889634
# A small vocabulary with no tiny probability at T = 0.7 (the smallest is 0.06), so that a 10% error
# in any of them moves its count by 10 standard deviations at 2^18 draws.
RACE_LOGITS = [0.0, 0.35, -0.2, 0.6, 0.1, -0.3, 0.45, 0.25]
TEMPERATURE = 0.7


def small(gpu: int, interpret: int) -> int:
    """A size for the GPU run, or the smaller one for the CPU interpreter."""
    return interpret if INTERPRET else gpu


def build(params: list[SamplingParams], vocab_size: int) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(SamplingRows(params, [None] * n, [[] for _ in range(n)], [0] * n), vocab_size, DEVICE)


# --- frequency checks ---------------------------------------------------------------------------


def frequency_errors(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float, float]:
    """(chi-square, its pass threshold, largest |z| of one token's count) of counts against probs."""
    counts, probs = counts.double().cpu(), probs.double().cpu()
    num_draws = counts.sum()
    expected = num_draws * probs
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    z = ((counts - expected) / (expected * (1 - probs)).sqrt()).abs().max().item()
    dof = len(probs) - 1
    return chi2, dof + 6 * math.sqrt(2 * dof), z


def assert_frequencies(counts: torch.Tensor, probs: torch.Tensor) -> None:
    chi2, threshold, z = frequency_errors(counts, probs)
    assert chi2 < threshold and z < 5, f"chi-square {chi2:.1f} (pass < {threshold:.1f}), max |z| {z:.1f}"


def assert_detects_errors(counts: torch.Tensor, logits: torch.Tensor) -> None:
    """The test is strong enough: the same counts fail against the wrong temperature (1.0) and
    against any one probability off by 10%."""
    wrong = [torch.softmax(logits.double(), dim=-1)]
    probs = torch.softmax(logits.double() / TEMPERATURE, dim=-1)
    for token in range(len(probs)):
        for factor in (0.9, 1.1):
            off = probs.clone()
            off[token] *= factor
            wrong.append(off / off.sum())
    for reference in wrong:
        chi2, threshold, z = frequency_errors(counts, reference)
        assert chi2 > threshold or z > 5, f"not detected: chi-square {chi2:.1f}, max |z| {z:.1f}"


# --- the noise --------------------------------------------------------------------------------


@triton.jit
def _noise_kernel(bits_ptr, out_ptr, n, FAST_LOG: tl.constexpr, BLOCK_N: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offsets < n
    bits = tl.load(bits_ptr + offsets, mask=mask, other=0).to(tl.uint32, bitcast=True)
    tl.store(out_ptr + offsets, _gumbel_log2(bits, FAST_LOG), mask=mask)


@triton.jit
def _race_kernel(logits_ptr, out_ptr, scale, seed, NUM_TOKENS: tl.constexpr, DRAWS: tl.constexpr,
                 FAST_LOG: tl.constexpr):
    """DRAWS samples per program by the kernel's race, each from its own Philox counters."""
    draws = tl.program_id(0) * DRAWS + tl.arange(0, DRAWS)
    tokens = tl.arange(0, NUM_TOKENS)
    bits = tl.randint(seed, draws[:, None] * NUM_TOKENS + tokens[None, :])
    scores = tl.load(logits_ptr + tokens)[None, :] * scale + _gumbel_log2(bits, FAST_LOG)
    tl.store(out_ptr + draws, tl.argmax(scores, axis=1))


@pytest.mark.parametrize("fast_log", FAST_LOG)
def test_noise_is_accurate_at_both_ends(fast_log: bool) -> None:
    """-log2(-ln U) (in log2 units, less the constant log2(log2 e)) against float64, from U near 0
    (the losing draws) to U = 1 - 2^-33 (the biggest win), across the series / log switch at 1/8."""
    ks = [0, 1, 2, 3, 1000, 2**20, 2**26, 2**29 - 1, 2**29, 2**29 + 1, 2**31 - 1, 2**31, 2**32 - 2**20, 2**32 - 1]
    ks += torch.randint(0, 2**32, (2000,), generator=torch.Generator().manual_seed(0)).tolist()
    bits = torch.tensor([k - 2**32 if k >= 2**31 else k for k in ks], dtype=torch.int32, device=DEVICE)
    out = torch.empty(len(ks), dtype=torch.float32, device=DEVICE)
    _noise_kernel[(triton.cdiv(len(ks), 1024),)](bits, out, len(ks), FAST_LOG=fast_log, BLOCK_N=1024)
    w = (torch.tensor(ks, dtype=torch.float64) + 0.5) / 2**32  # 1 - U
    expected = -torch.log2(-torch.log1p(-w) * LOG2E)
    # lg2.approx is good to about 2^-22, absolute near 1 and relative elsewhere.
    error = ((out.cpu().double() - expected).abs() / expected.abs().clamp_min(1.0)).max().item()
    assert torch.isfinite(out).all()
    assert error < (2e-5 if fast_log else 1e-6), f"noise off by {error:.2e}"


@pytest.mark.parametrize("fast_log", FAST_LOG)
def test_noise_race_frequencies_match_softmax(fast_log: bool) -> None:
    logits = torch.tensor(RACE_LOGITS, dtype=torch.float32)
    num_draws, per_program = 2**18, small(256, 2**14)  # the interpreter pays per program, a GPU per element
    tokens = torch.empty(num_draws, dtype=torch.int64, device=DEVICE)
    _race_kernel[(num_draws // per_program,)](logits.to(DEVICE), tokens, LOG2E / TEMPERATURE, 1234,
                                              NUM_TOKENS=len(RACE_LOGITS), DRAWS=per_program, FAST_LOG=fast_log)
    counts = torch.bincount(tokens.cpu(), minlength=len(RACE_LOGITS))
    assert_frequencies(counts, torch.softmax(logits.double() / TEMPERATURE, dim=-1))
    assert_detects_errors(counts, logits)


# --- gumbel_sample --------------------------------------------------------------------------------


@pytest.mark.parametrize("num_chunks", [None, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_greedy_rows_equal_argmax(dtype: torch.dtype, num_chunks: int | None) -> None:
    num_rows, vocab_size = small(130, 4), small(151936, 2 * BLOCK + 808)
    generator = torch.Generator().manual_seed(1)
    logits = (torch.randn(num_rows, vocab_size, generator=generator) * 4).to(dtype).to(DEVICE)
    # Ties: lowest id wins, within a tile, across tiles and across chunks, and in one lane of the scan
    # (columns a quarter tile or a tile apart). bf16 ties by itself too.
    logits[1, [7, 7 + BLOCK // 4, 7 + BLOCK, 3000, BLOCK + 5, vocab_size - 1]] = 100.0
    logits[2, [BLOCK + 1, vocab_size - 1]] = 100.0
    logits[3] = float("-inf")  # no best at all: id 0, like torch.argmax
    before = logits.clone()
    inv_temperatures = torch.zeros(num_rows, dtype=torch.float32, device=DEVICE)
    token_ids = gumbel_sample(logits, inv_temperatures, seed=5, num_chunks=num_chunks)
    assert token_ids.dtype == torch.int64 and token_ids.device == logits.device
    assert torch.equal(token_ids, logits.argmax(dim=-1))
    assert token_ids[1] == 7 and token_ids[2] == BLOCK + 1 and token_ids[3] == 0
    assert torch.equal(logits, before)


def test_ties_across_many_chunks() -> None:
    """More chunks than the reduction's lanes: chunks 0 and REDUCE_BLOCK share one."""
    vocab_size = small(151936, (REDUCE_BLOCK + 1) * BLOCK + 10)
    logits = torch.zeros(2, vocab_size, dtype=torch.bfloat16, device=DEVICE)
    logits[:, [5, REDUCE_BLOCK * BLOCK + 5]] = 1.0
    inv_temperatures = torch.zeros(2, dtype=torch.float32, device=DEVICE)
    token_ids = gumbel_sample(logits, inv_temperatures, seed=0, num_chunks=triton.cdiv(vocab_size, BLOCK))
    assert token_ids.tolist() == [5, 5]


def test_mixed_batch_greedy_rows_are_exact() -> None:
    num_rows, vocab_size = small(64, 6), small(32000, 5000)
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(num_rows, vocab_size, generator=generator).to(torch.bfloat16).to(DEVICE)
    inv_temperatures = torch.tensor([0.0 if row % 2 == 0 else 1 / (0.5 + row / num_rows) for row in range(num_rows)],
                                    dtype=torch.float32, device=DEVICE)
    before = logits.clone()
    token_ids = gumbel_sample(logits, inv_temperatures, seed=6)
    greedy = inv_temperatures == 0
    assert torch.equal(token_ids[greedy], logits.argmax(dim=-1)[greedy])
    assert ((token_ids >= 0) & (token_ids < vocab_size)).all()
    assert not torch.equal(token_ids[~greedy], logits.argmax(dim=-1)[~greedy])  # the others did sample
    assert torch.equal(logits, before)


def test_seeds_are_reproducible_and_independent_of_chunking() -> None:
    num_rows, vocab_size = small(32, 4), small(50000, 2 * BLOCK + 100)
    logits = torch.zeros(num_rows, vocab_size, dtype=torch.bfloat16, device=DEVICE)  # uniform
    inv_temperatures = torch.ones(num_rows, dtype=torch.float32, device=DEVICE)
    first = gumbel_sample(logits, inv_temperatures, seed=7)
    assert torch.equal(first, gumbel_sample(logits, inv_temperatures, seed=7))
    # A token's noise depends on (seed, row, column) only, so the grid does not change the draw.
    assert torch.equal(first, gumbel_sample(logits, inv_temperatures, seed=7, num_chunks=1))
    assert torch.equal(first, gumbel_sample(logits, inv_temperatures, seed=7, num_chunks=3))
    seeds = (8, 9, 2**61 + 1, 2**62 - 1)
    draws = {tuple(gumbel_sample(logits, inv_temperatures, seed=seed).tolist()) for seed in seeds}
    assert len(draws | {tuple(first.tolist())}) == 5
    assert len(set(first.tolist())) > 1  # rows draw their own noise


def test_temperature_scales_the_logits_not_the_noise() -> None:
    """At T = 0.5 the draw from logits x is the draw from 2x at T = 1 with the same noise: the
    scaling by a power of two is exact, so the tokens must be identical."""
    num_rows, vocab_size = 8, small(20000, 3000)
    logits = torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(17)).to(DEVICE)
    ones = torch.ones(num_rows, dtype=torch.float32, device=DEVICE)
    at_half = gumbel_sample(logits, 2 * ones, seed=18)
    assert torch.equal(at_half, gumbel_sample(2 * logits, ones, seed=18))
    assert not torch.equal(at_half, gumbel_sample(logits, ones, seed=18))


def test_uniform_logits_spread_over_all_tiles_and_quarters() -> None:
    """Each quarter of each tile has its own Philox output: a reused one would tie with another
    and lose to it every time (the lower column wins ties)."""
    vocab_size = 2 * BLOCK
    num_rows = small(4096, 96)
    logits = torch.zeros(1, vocab_size, dtype=torch.float16, device=DEVICE).expand(num_rows, -1)
    token_ids = gumbel_sample(logits, torch.ones(num_rows, dtype=torch.float32, device=DEVICE), seed=10)
    num_parts = vocab_size // (BLOCK // 4)
    counts = torch.bincount(token_ids.cpu() // (BLOCK // 4), minlength=num_parts)
    assert_frequencies(counts, torch.full((num_parts,), 1 / num_parts))
    assert (counts > 0).all()


def test_sampled_frequencies_match_softmax() -> None:
    """Eight live tokens spread over every quarter of the first tile and over three tiles and
    three chunks, all other logits -inf; many rows of the same logits in one call."""
    vocab_size = 2 * BLOCK + 100
    live = [3, BLOCK // 4 + 10, BLOCK // 2 + 700, 3 * BLOCK // 4 + 1, BLOCK + 5, BLOCK + 3000, 2 * BLOCK + 1,
            vocab_size - 1]
    row = torch.full((vocab_size,), float("-inf"))
    row[live] = torch.tensor(RACE_LOGITS)
    num_rows = small(2**18, 64)
    logits = row.to(DEVICE)[None].expand(num_rows, -1)  # stride 0 between rows: no memory
    inv_temperatures = torch.full((num_rows,), 1 / TEMPERATURE, dtype=torch.float32, device=DEVICE)
    token_ids = gumbel_sample(logits, inv_temperatures, seed=11, num_chunks=3).cpu()
    assert torch.isin(token_ids, torch.tensor(live)).all()
    counts = torch.bincount(token_ids, minlength=vocab_size)[live]
    logits_live = torch.tensor(RACE_LOGITS, dtype=torch.float32)
    assert_frequencies(counts, torch.softmax(logits_live.double() / TEMPERATURE, dim=-1))
    if not INTERPRET:  # 64 draws (the interpreter's) only catch gross errors
        assert_detects_errors(counts, logits_live)


def test_nan_logits_are_never_chosen() -> None:
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(19)).to(DEVICE)
    nan_columns = [0, 1, 500, 999]
    logits[:, nan_columns] = float("nan")
    token_ids = gumbel_sample(logits, torch.tensor([0.5, 1.0, 2.0, 100.0], device=DEVICE), seed=20)
    assert not torch.isin(token_ids.cpu(), torch.tensor(nan_columns)).any()


@pytest.mark.parametrize("num_chunks", [1, 2, 3, 7])
def test_odd_vocab_and_forced_chunks_give_ids_in_range(num_chunks: int) -> None:
    vocab_size = 3 * BLOCK + 17
    logits = torch.randn(3, vocab_size, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    inv_temperatures = torch.tensor([0.0, 1.0, 20.0], dtype=torch.float32, device=DEVICE)
    token_ids = gumbel_sample(logits, inv_temperatures, seed=13, num_chunks=num_chunks)
    assert ((token_ids >= 0) & (token_ids < vocab_size)).all()
    assert token_ids[0] == logits[0].argmax()
    assert torch.equal(token_ids, gumbel_sample(logits, inv_temperatures, seed=13))


def test_default_chunking_fills_the_device() -> None:
    num_rows = small(130, 5)
    num_programs = num_rows * default_num_chunks(num_rows, 151936, DEVICE)
    sms = num_sms(DEVICE, INTERPRETER_NUM_SMS)
    assert 2 * sms <= num_programs <= 4 * sms
    assert default_num_chunks(1, 100, DEVICE) == 1  # never more chunks than tiles
    assert default_num_chunks(10**6, 151936, DEVICE) == 1


def test_bad_arguments_are_rejected() -> None:
    logits = torch.zeros(2, 10, device=DEVICE)
    inv = torch.ones(2, dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="num_rows, vocab_size"):
        gumbel_sample(logits[0], inv, 0)
    with pytest.raises(ValueError, match="inv_temperatures"):
        gumbel_sample(logits, inv[:1], 0)
    with pytest.raises(ValueError, match="inv_temperatures"):
        gumbel_sample(logits, inv.double(), 0)
    with pytest.raises(ValueError, match="float64"):
        gumbel_sample(logits.double(), inv, 0)
    with pytest.raises(ValueError, match="seed"):
        gumbel_sample(logits, inv, -1)
    with pytest.raises(ValueError, match="empty"):
        gumbel_sample(logits[:, :0], inv, 0)
    assert gumbel_sample(logits[:0], inv[:0], 0).shape == (0,)
    with pytest.raises(ValueError, match=r"columns \[5, 15\) outside a vocabulary of 12"):
        gumbel_best(logits, inv, 0, column_offset=5, vocab_size=12)


# --- the sampler ----------------------------------------------------------------------------------


def fused_sampler(seed: int) -> Sampler:
    return Sampler(seed=seed, fused=True if INTERPRET else None)


def test_sampler_takes_the_fused_path_for_plain_temperature() -> None:
    vocab_size = small(151936, 3000)
    params = [P(temperature=0.8), P(temperature=0.0), P(temperature=1.5), P(temperature=0.0, top_k=3, seed=4)]
    batch = build(params, vocab_size)
    assert batch.is_plain_temperature and not batch.is_all_greedy  # filters and seeds of greedy rows do not count
    assert batch.inv_temperatures.tolist() == pytest.approx([1 / 0.8, 0.0, 1 / 1.5, 0.0])
    logits = torch.randn(4, vocab_size, generator=torch.Generator().manual_seed(14)).to(DEVICE) * 0.1
    sampler, seeds = fused_sampler(seed=15), random.Random(15)
    for _ in range(2):  # each call draws the next seed
        expected = gumbel_sample(logits, batch.inv_temperatures, seeds.getrandbits(62))
        assert torch.equal(sampler.sample(logits, batch).token_ids, expected)


@pytest.mark.parametrize("params", [
    [P(top_k=5), P()],
    [P(top_p=0.9), P()],
    [P(min_p=0.1), P()],
    [P(seed=3), P()],
    [P(logprobs=True), P()],
    [P(temperature=0.0, logprobs=True), P()],
    [P(temperature=0.0, repetition_penalty=1.2), P()],
    [P(frequency_penalty=0.5), P()],
    [P(temperature=0.0), P(temperature=0.0)],  # all greedy: one argmax
], ids=["top_k", "top_p", "min_p", "seed", "logprobs", "greedy_logprobs", "repetition", "frequency", "all_greedy"])
def test_other_batches_keep_the_torch_path(
    params: list[SamplingParams], monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("took the fused path")

    monkeypatch.setattr("worker_service.sampling.fused_sampling.gumbel_sample", fail)
    vocab_size = 50
    n = len(params)
    batch = SamplingBatch.build(SamplingRows(params, [[1, 2]] * n, [[3]] * n, [0] * n), vocab_size, DEVICE)
    assert batch.inv_temperatures is None
    assert batch.is_plain_temperature == all(p.is_greedy for p in params)
    logits = torch.randn(n, vocab_size, device=DEVICE)
    token_ids = fused_sampler(seed=16).sample(logits, batch).token_ids
    assert ((token_ids >= 0) & (token_ids < vocab_size)).all()


def test_fused_path_can_be_turned_off_and_skips_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr("worker_service.sampling.fused_sampling.gumbel_sample",
                        lambda logits, inv, seed: calls.append(seed))
    batch = build([P(), P(temperature=0.5)], 20)
    logits = torch.randn(2, 20, device=DEVICE)
    Sampler(fused=False).sample(logits, batch)
    fused_sampler(seed=0).sample(logits.double(), batch)
    assert not calls


def test_fused_request_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    batch = SamplingBatch.build(SamplingRows([P()], [None], [[]], [0]), 20, "cpu")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        Sampler(fused=True).sample(torch.zeros(1, 20), batch)
    assert Sampler().sample(torch.zeros(1, 20), batch).token_ids.shape == (1,)  # auto: the torch path on the CPU


def test_fused_step_has_no_host_sync() -> None:
    if INTERPRET:
        pytest.skip("needs a CUDA device")
    params = [P(temperature=0.7), P(temperature=0.0)] * 64
    logits = torch.randn(len(params), 151936, device=DEVICE, dtype=torch.bfloat16)
    sampler = Sampler()
    sampler.sample(logits, build(params, 151936))  # warm-up: compiles the kernels
    torch.cuda.synchronize()
    # Keep the GPU busy for a while: if building or sampling waited for it, it would be idle after.
    torch.cuda._sleep(2_000_000_000)
    out = sampler.sample(logits, build(params, 151936))
    assert not torch.cuda.current_stream().query(), "the host waited for the GPU"
    torch.cuda.synchronize()
    assert torch.equal(out.token_ids[1::2], logits[1::2].argmax(dim=-1))


# Slices that start inside a tile of the kernel (4,096 columns) and on a tile's edge, over a smaller
# vocabulary than Qwen3's so that the CPU interpreter runs each case in seconds.
@pytest.mark.parametrize("bounds", [[0, 7_000, 20_000], [0, 10_000, 20_000], [0, 4096, 5000, 20_000]])
def test_slices_of_the_vocabulary_give_the_whole_rows_tokens(bounds: list[int]) -> None:
    """Tensor parallelism samples from each rank's slice of the logits (gumbel_best with the slice's
    first id) and keeps the best of the slices' bests (vocab_parallel.pick_best): the same tokens as
    gumbel_sample on the whole rows, for slices that start inside a tile too. Greedy rows included,
    and a row whose maximum appears in two slices (the lower id wins, as argmax)."""
    vocab_size = bounds[-1]
    logits = torch.randn(6, vocab_size, generator=torch.Generator().manual_seed(4)).to(DEVICE, torch.bfloat16)
    logits[5, [3, vocab_size - 2]] = 20.0  # a tie across the first and last slice, on a greedy row
    inv_temperatures = torch.tensor([1.0, 0.0, 1.7, 0.5, 1.0, 0.0], device=DEVICE)
    expected = gumbel_sample(logits, inv_temperatures, seed=21)
    pairs = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        values, token_ids = gumbel_best(logits[:, start:end], inv_temperatures, 21, start, vocab_size)
        assert ((start <= token_ids) & (token_ids < end)).all()
        pairs.append(torch.stack([values, token_ids.float()], dim=1))
    assert torch.equal(pick_best(torch.stack(pairs)), expected)
    assert expected[5] == 3 and expected[1] == logits[1].argmax()
