"""The fused q/k norm + rotary + K/V store kernel (triton_rope_store) against the eager composition
it replaces: `norm.rms_norm`, then `rotary.apply_rotary`, then a store at slot_mapping.

Runs on a CUDA device. Without one the module is skipped before Triton is imported, unless
TRITON_INTERPRET=1 is set: then it runs on the CPU through Triton's interpreter at small sizes, in
float16 instead of bfloat16 (the interpreter truncates float32 to bfloat16 instead of rounding to
nearest even, so none of its bf16 results can match PyTorch's), and float32 (the interpreter needs
numpy < 2.3: see tests/worker_service/triton_runtime.py, which sets TRITON_INTERPRET where it works).

Results must be bit-identical. The one exception is the norm's float32 sum of squares, whose
reduction order is PyTorch's own (it differs between CPU ISAs and CUDA launch shapes): the exact
tests with norms therefore draw q and k from a grid (multiples of 1/16 up to 4 in magnitude) on which
every partial sum is exact in float32, so that any order gives the same variance and every other
rounding is still exercised; one more test bounds the difference on general inputs. Every check
draws fresh random inputs, poisons the caches with NaN and requires that exactly the slots of real
tokens were written.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.worker_service.triton_runtime import DEVICE, INTERPRET, skip_module_unless_kernels_run

skip_module_unless_kernels_run()

from worker_service.attention import get_attention_backend  # noqa: E402
from worker_service.attention.base import AttentionMetadata  # noqa: E402
from worker_service.attention.triton_rope_store import SPLIT_MAX_TOKENS, rope_and_store  # noqa: E402
from worker_service.layers import RMSNorm, RotaryEmbedding, norm, rotary  # noqa: E402

pytestmark = pytest.mark.gpu

LOW = torch.float16 if INTERPRET else torch.bfloat16  # the serving dtype (bf16 on the GPU)
DTYPES = [LOW, torch.float32]
HEAD_DIMS = [32, 64] if INTERPRET else [64, 128]
# Query heads per KV head; with NUM_KV_HEADS, 6 and 8 give a token more q heads than one program of a
# split token takes (Q_HEADS_PER_PROGRAM): two q programs, the second partly masked at 12 heads.
GROUPS = [1, 2, 4, 6, 8]
NUM_KV_HEADS = 2
BLOCK_SIZES = [16, 256]
EPS = 1e-6


def small(gpu: int, interpret: int) -> int:
    """A size for the GPU run, or the smaller one for the CPU interpreter."""
    return interpret if INTERPRET else gpu


@dataclass
class Case:
    """One layer's new tokens: q, k, v as strided views of one qkv tensor, positions into the
    rotary tables, norm weights (or None), and a NaN-poisoned paged cache with its slot mapping."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    rotary: RotaryEmbedding
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slots: torch.Tensor  # [num_tokens] int64, -1 for padding tokens


def make_case(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, *,
              block_size: int, with_norm: bool, on_grid: bool, seed: int, cache_dtype: torch.dtype | None = None,
              max_positions: int = 300) -> Case:
    generator = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if on_grid:
        # Multiples of 1/16 up to 4: squares are multiples of 2**-8 up to 16, so every partial sum of
        # up to 256 of them needs at most 20 bits and is exact in float32 whatever the order.
        qkv = torch.randint(-64, 65, (num_tokens, width), generator=generator) / 16
    else:
        qkv = 1.5 * torch.randn(num_tokens, width, generator=generator)
    qkv = qkv.to(DEVICE, dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    positions = torch.randint(0, max_positions, (num_tokens,), generator=generator)
    positions[:2] = torch.tensor([0, max_positions - 1])[:num_tokens]  # both ends of the tables
    num_blocks = max(2, -(-num_tokens // block_size) + 1)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[torch.rand(num_tokens, generator=generator) < 0.2] = -1
    slots[min(2, num_tokens - 1)] = -1  # at least one padding token
    weights = [(1 + 0.5 * torch.randn(head_dim, generator=generator)).to(DEVICE, dtype) for _ in range(2)]
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return Case(
        q=q.reshape(num_tokens, num_heads, head_dim), k=k.reshape(num_tokens, num_kv_heads, head_dim),
        v=v.reshape(num_tokens, num_kv_heads, head_dim), positions=positions.to(DEVICE),
        rotary=RotaryEmbedding(head_dim, max_positions, 1e6 if seed % 2 else 1e4).to(DEVICE),
        q_norm=weights[0] if with_norm else None, k_norm=weights[1] if with_norm else None,
        k_cache=torch.full(cache_shape, float("nan"), dtype=cache_dtype or dtype, device=DEVICE),
        v_cache=torch.full(cache_shape, float("nan"), dtype=cache_dtype or dtype, device=DEVICE),
        slots=slots.to(DEVICE))


def run_fused(case: Case) -> torch.Tensor:
    return rope_and_store(case.q, case.k, case.v, case.positions, case.rotary.cos, case.rotary.sin, case.k_cache,
                          case.v_cache, case.slots, q_norm_weight=case.q_norm, k_norm_weight=case.k_norm, eps=EPS)


def eager(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated q and k as the eager layers compute them (the uncompiled functions, called directly)."""
    q, k = case.q, case.k
    if case.q_norm is not None and case.k_norm is not None:
        q, k = norm.rms_norm(q, case.q_norm, EPS), norm.rms_norm(k, case.k_norm, EPS)
    return rotary.apply_rotary(case.positions, q, k, case.rotary.cos, case.rotary.sin)


def check_cache(case: Case, ref_k: torch.Tensor, what: str, k_close: bool = False) -> None:
    """The slots of real tokens hold the rotated k and the plain v (converted to the cache dtype),
    every other slot still holds the NaN poison."""
    keep = case.slots >= 0
    written = torch.zeros(case.k_cache.shape[0] * case.k_cache.shape[1], dtype=torch.bool, device=DEVICE)
    written[case.slots[keep]] = True
    num_kv_heads, head_dim = case.k_cache.shape[2:]
    for name, cache, new in (("k", case.k_cache, ref_k), ("v", case.v_cache, case.v)):
        flat = cache.view(-1, num_kv_heads, head_dim)
        assert torch.isnan(flat[~written]).all(), f"{what}: {name} written outside the real tokens' slots"
        stored, expected = flat[case.slots[keep]], new[keep].to(cache.dtype)
        assert not torch.isnan(stored).any(), f"{what}: {name} not written at some slot"
        if name == "k" and k_close:
            assert_within_one_rounding(stored, expected, f"{what}: k cache")
        else:
            assert torch.equal(stored, expected), f"{what}: {name} cache differs from eager"


def assert_within_one_rounding(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """out and ref differ only as a last-bits difference of the norm's variance allows.

    Low precision: the float32 normalised values differ by far less than one unit of the dtype, so
    at most one rounding lands the other way (1 unit), the weight product adds one more, and
    rotary mixes two such values with |cos| + |sin| <= sqrt(2), plus its own rounding: under
    4 eps * max|row|. float32: every rounding shows; the variance can differ by up to (D - 1)
    units in the worst order, hence (D + 4) eps * max|row|. In both, eps is the dtype's machine
    epsilon and max|row| the largest magnitude in that head's row of ref.
    """
    eps = torch.finfo(ref.dtype).eps
    factor = 4 if ref.dtype != torch.float32 else ref.shape[-1] + 4
    bound = factor * eps * ref.float().abs().amax(-1, keepdim=True)
    error = (out.float() - ref.float()).abs()
    worst = (error / bound).max().item()
    assert worst <= 1, f"{what}: difference {worst:.2f} times the one-rounding bound"
    if ref.dtype != torch.float32:
        # A boundary crossing needs the float32 values to straddle a rounding point: rare.
        mismatched = (out != ref).float().mean().item()
        assert mismatched < 0.01, f"{what}: {mismatched:.2%} of elements differ"


# ---------------------------------------------------------------------------------------------- kernel


# Past SPLIT_MAX_TOKENS a token's work is one program (unless the cache is fp8); at or below it, several.
NUM_TOKENS = [small(300, 24), SPLIT_MAX_TOKENS - 3]


@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("with_norm", [False, True], ids=["plain", "qk_norm"])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_eager_composition(dtype: torch.dtype, head_dim: int, group: int, with_norm: bool,
                                   block_size: int, num_tokens: int) -> None:
    case = make_case(num_tokens, NUM_KV_HEADS * group, NUM_KV_HEADS, head_dim, dtype, block_size=block_size,
                     with_norm=with_norm, on_grid=with_norm, seed=head_dim * 100 + group * 10 + block_size % 7,
                     max_positions=small(4096, 300))
    what = f"{dtype} d={head_dim} group={group} norm={with_norm} bs={block_size} tokens={num_tokens}"
    out = run_fused(case)
    ref_q, ref_k = eager(case)
    assert out.is_contiguous() and out.dtype == dtype
    assert torch.equal(out, ref_q), f"{what}: q differs from eager, max |diff| {(out - ref_q).abs().max().item()}"
    check_cache(case, ref_k, what)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norm_on_general_inputs_is_within_one_rounding(dtype: torch.dtype, head_dim: int) -> None:
    """Off the grid the variance may differ in its last bits from PyTorch's reduction order."""
    case = make_case(small(300, 40), 8, 2, head_dim, dtype, block_size=16, with_norm=True, on_grid=False,
                     seed=head_dim)
    out = run_fused(case)
    ref_q, ref_k = eager(case)
    assert_within_one_rounding(out, ref_q, f"{dtype} d={head_dim}: q")
    check_cache(case, ref_k, f"{dtype} d={head_dim}", k_close=True)


@pytest.mark.parametrize("with_norm", [False, True], ids=["plain", "qk_norm"])
def test_float32_activations_into_a_low_precision_cache(with_norm: bool) -> None:
    """k is rotated in float32 and rounded once, to the cache dtype, as store_kv's conversion does."""
    case = make_case(small(64, 12), 4, 2, HEAD_DIMS[-1], torch.float32, block_size=16, with_norm=with_norm,
                     on_grid=True, seed=3, cache_dtype=LOW)
    out = run_fused(case)
    ref_q, ref_k = eager(case)
    assert torch.equal(out, ref_q)
    check_cache(case, ref_k, f"float32 into {LOW}")


def test_all_padding_and_empty_batches() -> None:
    """A batch of padding tokens only writes q and leaves the cache alone; no tokens, no launch."""
    case = make_case(small(32, 6), 4, 2, HEAD_DIMS[0], LOW, block_size=16, with_norm=True, on_grid=True, seed=4)
    case.slots.fill_(-1)
    out = run_fused(case)
    assert torch.equal(out, eager(case)[0])
    assert torch.isnan(case.k_cache).all() and torch.isnan(case.v_cache).all()
    empty = make_case(1, 4, 2, HEAD_DIMS[0], LOW, block_size=16, with_norm=False, on_grid=False, seed=5)
    for name in ("q", "k", "v", "positions", "slots"):
        setattr(empty, name, getattr(empty, name)[:0])
    assert run_fused(empty).shape == (0, 4, HEAD_DIMS[0])


@pytest.mark.skipif(INTERPRET, reason="model shapes are too large for the interpreter")
def test_decode_batch_at_model_shapes() -> None:
    """Qwen3-0.6B's attention (16 q heads, 8 KV heads, head_dim 128) for a decode batch of 256."""
    for with_norm in (False, True):
        case = make_case(256, 16, 8, 128, LOW, block_size=256, with_norm=with_norm, on_grid=with_norm, seed=6,
                         max_positions=40960)
        out = run_fused(case)
        ref_q, ref_k = eager(case)
        assert torch.equal(out, ref_q), f"norm={with_norm}: q differs from eager"
        check_cache(case, ref_k, f"model shapes norm={with_norm}")


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need a CUDA device")
def test_replays_in_a_cuda_graph() -> None:
    """Captured once, replayed with new activations, positions and slots in the same tensors."""
    case = make_case(16, 16, 8, 128, LOW, block_size=16, with_norm=True, on_grid=True, seed=7)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run_fused(case)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = run_fused(case)
    for replay in range(2):
        fresh = make_case(16, 16, 8, 128, LOW, block_size=16, with_norm=True, on_grid=True, seed=8 + replay)
        for name in ("q", "k", "v", "positions", "slots", "q_norm", "k_norm"):
            getattr(case, name).copy_(getattr(fresh, name))
        case.k_cache.fill_(float("nan"))
        case.v_cache.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_q, ref_k = eager(case)
        assert torch.equal(graph_out, ref_q), f"replay {replay}: q differs"
        check_cache(case, ref_k, f"replay {replay}")


def test_rejects_operands_it_cannot_handle() -> None:
    case = make_case(4, 4, 2, HEAD_DIMS[0], LOW, block_size=16, with_norm=True, on_grid=True, seed=9)
    d = HEAD_DIMS[0]
    bad = {
        "share one dtype": dict(k=case.k.float()),
        "float32 [max_positions": dict(cos=case.rotary.cos.to(LOW)),
        "q_norm_weight must be a contiguous": dict(q_norm_weight=case.q_norm[: d // 2]),
        "k_norm_weight must be a contiguous": dict(k_norm_weight=case.k_norm.float()),
        "slot_mapping must be int32/int64": dict(slot_mapping=case.slots[:3]),
        "positions must be int32/int64": dict(positions=case.positions.float()),
        "caches must be": dict(k_cache=case.k_cache[:, :, :1]),
        "contiguous last dimension": dict(v=case.v.transpose(1, 2).contiguous().transpose(1, 2)),
        "power of two": dict(q=case.q[..., :24], k=case.k[..., :24], v=case.v[..., :24],
                             k_cache=case.k_cache[..., :24], v_cache=case.v_cache[..., :24],
                             cos=case.rotary.cos[:, :12], sin=case.rotary.sin[:, :12], q_norm_weight=None,
                             k_norm_weight=None),
    }
    for message, overrides in bad.items():
        operands = dict(q=case.q, k=case.k, v=case.v, positions=case.positions, cos=case.rotary.cos,
                        sin=case.rotary.sin, k_cache=case.k_cache, v_cache=case.v_cache, slot_mapping=case.slots,
                        q_norm_weight=case.q_norm, k_norm_weight=case.k_norm)
        operands.update(overrides)
        with pytest.raises(ValueError, match=message.replace("[", r"\[")):
            rope_and_store(**operands, eps=EPS)


# ---------------------------------------------------------------------------------------------- backend


@pytest.mark.parametrize("with_norm", [False, True], ids=["llama", "qwen3"])
def test_backend_matches_the_default_composition(with_norm: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton backend's override against AttentionBackend's default (which the torch backend
    inherits), both called the way the model's Attention layer calls them."""
    # The default goes through the layers' kernel tables; keep them eager (a GPU test session may
    # have swapped in compiled versions).
    monkeypatch.setitem(norm.KERNELS, "rms_norm", norm.rms_norm)
    monkeypatch.setitem(rotary.KERNELS, "rotary", rotary.apply_rotary)
    case = make_case(small(64, 10), 8, 2, HEAD_DIMS[-1], LOW, block_size=16, with_norm=with_norm,
                     on_grid=with_norm, seed=10)
    head_dim = HEAD_DIMS[-1]
    norms = [None, None]
    if with_norm:
        norms = [RMSNorm(head_dim, EPS).to(DEVICE, LOW) for _ in range(2)]
        for module, weight in zip(norms, (case.q_norm, case.k_norm), strict=True):
            module.weight.copy_(weight)
    num_tokens = case.q.shape[0]
    metadata = AttentionMetadata(
        slot_mapping=case.slots, query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=DEVICE),
        block_tables=torch.zeros(1, 1, dtype=torch.int32, device=DEVICE), max_query_len=num_tokens,
        max_seq_len=num_tokens, block_size=case.k_cache.shape[1])
    caches = {}
    outputs = {}
    for name in ("torch", "triton"):
        caches[name] = (case.k_cache.clone(), case.v_cache.clone())
        outputs[name] = get_attention_backend(name).rope_and_store(
            case.q, case.k, case.v, case.positions, case.rotary, norms[0], norms[1], *caches[name], metadata)
    assert torch.equal(outputs["triton"], outputs["torch"]), "q differs"
    for index, name in enumerate("kv"):
        triton_cache, torch_cache = caches["triton"][index], caches["torch"][index]
        same = (triton_cache == torch_cache) | (torch.isnan(triton_cache) & torch.isnan(torch_cache))
        assert same.all(), f"{name} caches differ"
