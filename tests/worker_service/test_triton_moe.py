"""The fused expert kernels (layers/triton_moe) against a plain loop over the experts, on random
inputs of many token counts: experts that get no token, a rank's slice of the experts (tensor
parallelism), every block configuration, float32 and 16-bit.

Runs on a CUDA device, or on the CPU through Triton's interpreter at small sizes.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.worker_service.triton_runtime import DEVICE, INTERPRET, skip_module_unless_kernels_run

skip_module_unless_kernels_run()

from worker_service.layers.triton_moe import MoeConfig, align, fused_experts, max_blocks  # noqa: E402

pytestmark = pytest.mark.gpu
# The interpreter truncates float32 -> bfloat16 instead of rounding: float16 stands in for it there.
LOW = torch.float16 if INTERPRET else torch.bfloat16
TOKEN_COUNTS = [1, 3, 17, 64] if INTERPRET else [1, 2, 7, 16, 63, 256, 1000, 4096, 5000]
CONFIGS = [MoeConfig(16, 32, 64, 4, 2), MoeConfig(32, 64, 32, 4, 2), MoeConfig(64, 64, 64, 4, 3),
           MoeConfig(128, 128, 64, 8, 3)]


def loop_over_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                      weights: torch.Tensor, first_expert: int) -> torch.Tensor:
    """Each local expert on the rows that chose it, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    inter = w13.shape[1] // 2
    for expert in range(w13.shape[0]):
        tokens, slots = torch.nonzero(ids == first_expert + expert, as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate_up = x[tokens].double() @ w13[expert].double().T
        hidden = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, tokens, (hidden @ w2[expert].double().T) * weights[tokens, slots, None].double())
    return out


def routing(num_tokens: int, num_experts: int, top_k: int, hot: int | None = None,
            seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] and renormalised weights; with `hot`, every token picks among the first `hot`
    experts only, so that the others get no token."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=generator)
    if hot is not None:
        logits[:, hot:] = float("-inf")
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return ids.to(DEVICE), (weights / weights.sum(-1, keepdim=True)).to(DEVICE)


def experts(num_experts: int, hidden: int, inter: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=DEVICE) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, device=DEVICE) / inter**0.5
    return w13.to(dtype), w2.to(dtype)


def assert_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert out.dtype == dtype and out.shape == expected.shape
    error = ((out.double() - expected).norm() / expected.norm().clamp_min(1e-30)).item()
    assert error < (1e-5 if dtype == torch.float32 else 1e-2), f"{what}: relative error {error:.2e}"


@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("dtype", [torch.float32, LOW])
def test_matches_loop_over_experts(num_tokens: int, dtype: torch.dtype) -> None:
    num_experts, top_k, hidden, inter = (16, 4, 64, 48) if INTERPRET else (64, 8, 256, 96)
    ids, weights = routing(num_tokens, num_experts, top_k, seed=num_tokens)
    w13, w2 = experts(num_experts, hidden, inter, dtype)
    x = torch.randn(num_tokens, hidden, device=DEVICE).to(dtype)
    out = fused_experts(x, w13, w2, ids, weights, 0)
    assert_close(out, loop_over_experts(x, w13, w2, ids, weights, 0), dtype, f"{num_tokens} tokens")


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"m{c.block_m}n{c.block_n}k{c.block_k}")
def test_every_configuration_and_idle_experts(config: MoeConfig) -> None:
    """Only 5 of 32 experts get tokens; hidden and inter not multiples of the tiles."""
    num_tokens = 40 if INTERPRET else 700
    ids, weights = routing(num_tokens, 32, 2, hot=5)
    w13, w2 = experts(32, 80, 72, torch.float32)
    x = torch.randn(num_tokens, 80, device=DEVICE)
    out = fused_experts(x, w13, w2, ids, weights, 0, config)
    assert_close(out, loop_over_experts(x, w13, w2, ids, weights, 0), torch.float32, str(config))


@pytest.mark.parametrize("first_expert", [0, 8, 24])
def test_a_ranks_slice_of_the_experts(first_expert: int) -> None:
    """Tensor parallelism: 8 of 32 experts on this rank; entries of other experts add nothing, and a
    token whose experts are all elsewhere gets zeros."""
    num_tokens = 33 if INTERPRET else 300
    ids, weights = routing(num_tokens, 32, 4)
    ids[0] = torch.tensor([28, 29, 30, 31]) if first_expert != 24 else torch.tensor([0, 1, 2, 3])
    full_w13, full_w2 = experts(32, 64, 48, torch.float32)
    w13, w2 = full_w13[first_expert:first_expert + 8], full_w2[first_expert:first_expert + 8]
    x = torch.randn(num_tokens, 64, device=DEVICE)
    out = fused_experts(x, w13, w2, ids, weights, first_expert)
    assert_close(out, loop_over_experts(x, w13, w2, ids, weights, first_expert), torch.float32, "slice")
    assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_rows_do_not_depend_on_their_batch() -> None:
    """A token's output is the same bits whether it comes alone or among others taking the same block
    configuration (a row's result does not depend on where in its block it sits)."""
    config = MoeConfig(16, 32, 64, 4, 2)
    num_tokens = 24 if INTERPRET else 200
    ids, weights = routing(num_tokens, 16, 2)
    w13, w2 = experts(16, 64, 48, LOW)
    x = torch.randn(num_tokens, 64, device=DEVICE).to(LOW)
    together = fused_experts(x, w13, w2, ids, weights, 0, config)
    for row in (0, num_tokens // 2, num_tokens - 1):
        alone = fused_experts(x[row:row + 1], w13, w2, ids[row:row + 1], weights[row:row + 1], 0, config)
        assert torch.equal(alone[0], together[row])


def test_align_groups_entries_by_expert() -> None:
    """sorted_entries holds each local expert's entries in one padded group, block_experts names each
    block's expert, and every block past the last group is -1."""
    ids, _ = routing(50, 8, 2, seed=3)
    block_m = 16
    sorted_entries, block_experts = align(ids, 2, 4, block_m)
    flat = ids.flatten().cpu()
    assert sorted_entries.numel() == block_m * max_blocks(flat.numel(), 4, block_m)
    seen = []
    for block, expert in enumerate(block_experts.cpu().tolist()):
        rows = sorted_entries[block * block_m:(block + 1) * block_m].cpu()
        real = rows[rows < flat.numel()]
        if expert < 0:
            assert real.numel() == 0
            continue
        assert torch.all(flat[real] == 2 + expert)
        seen += real.tolist()
    mine = torch.nonzero((flat >= 2) & (flat < 6)).flatten().tolist()
    assert sorted(seen) == mine
