"""The Qwen3-MoE block on the CPU: the reference expert kernel against a direct per-token sum (a rank's
slice of the experts, experts that get no token), routing against transformers' router (float32 and
bfloat16), the whole block against transformers' block bit for bit in float32, the MoE fields of the
model config, and the errors when the experts do not divide over the ranks."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from common.contract.config import WorkerConfig
from tests.tiny_models import make_tiny_checkpoint
from worker_service.attention import get_attention_backend
from worker_service.layers import RMSNorm, SparseMoeBlock
from worker_service.layers.moe import KERNELS, Experts, reference_experts
from worker_service.loader.weight_mapping import load_named_tensor
from worker_service.models import build_model
from worker_service.models.config import ModelConfig
from worker_service.parallel import distributed
from worker_service.runtime.tp_group import check_tensor_parallel

HIDDEN, INTERMEDIATE, NUM_EXPERTS = 32, 16, 6


def random_experts(num_experts: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * INTERMEDIATE, HIDDEN, generator=generator) / HIDDEN**0.5
    w2 = torch.randn(num_experts, HIDDEN, INTERMEDIATE, generator=generator) / INTERMEDIATE**0.5
    return w13, w2


def direct_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                   first_expert: int) -> torch.Tensor:
    """Token by token, chosen expert by chosen expert: the definition of the kernel's result."""
    out = torch.zeros_like(x)
    for token in range(x.shape[0]):
        for expert, weight in zip(ids[token].tolist(), weights[token].tolist(), strict=True):
            local = expert - first_expert
            if not 0 <= local < w13.shape[0]:
                continue
            gate, up = (w13[local] @ x[token]).chunk(2)
            out[token] += weight * (w2[local] @ (F.silu(gate) * up))
    return out


# Token rows of 2 chosen experts of 6: expert 4 gets no token, expert 1 one, expert 0 five.
IDS = torch.tensor([[0, 1], [0, 2], [3, 0], [5, 3], [2, 5], [0, 3], [5, 0]])


@pytest.mark.parametrize(("first_expert", "num_local"), [(0, 6), (3, 3), (2, 2)], ids=["all", "last-half", "middle"])
def test_reference_experts_equal_direct_sum(first_expert: int, num_local: int) -> None:
    w13, w2 = random_experts(NUM_EXPERTS)
    x = torch.randn(IDS.shape[0], HIDDEN, generator=torch.Generator().manual_seed(1))
    weights = torch.rand(IDS.shape, generator=torch.Generator().manual_seed(2))
    local = slice(first_expert, first_expert + num_local)
    out = reference_experts(x, w13[local], w2[local], IDS, weights, first_expert)
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out, direct_experts(x, w13[local], w2[local], IDS, weights, first_expert))
    untouched = ~((IDS >= first_expert) & (IDS < first_expert + num_local)).any(dim=1)
    assert torch.equal(out[untouched], torch.zeros_like(out[untouched]))  # no local expert chosen: zeros


def test_rank_partials_sum_to_the_whole() -> None:
    """What tensor parallelism relies on: the partials of two halves of the experts add up to the whole."""
    w13, w2 = random_experts(NUM_EXPERTS)
    x = torch.randn(IDS.shape[0], HIDDEN, generator=torch.Generator().manual_seed(3))
    weights = torch.rand(IDS.shape, generator=torch.Generator().manual_seed(4))
    whole = reference_experts(x, w13, w2, IDS, weights, 0)
    halves = [reference_experts(x, w13[r * 3:(r + 1) * 3], w2[r * 3:(r + 1) * 3], IDS, weights, r * 3) for r in (0, 1)]
    torch.testing.assert_close(halves[0] + halves[1], whole)


def test_reference_experts_keep_the_activation_dtype_and_take_no_tokens() -> None:
    w13, w2 = random_experts(NUM_EXPERTS)
    x = torch.randn(IDS.shape[0], HIDDEN).to(torch.bfloat16)
    weights = torch.rand(IDS.shape)
    out = reference_experts(x, w13.to(torch.bfloat16), w2.to(torch.bfloat16), IDS, weights, 0)
    assert out.dtype == torch.bfloat16
    reference = direct_experts(x.float(), w13, w2, IDS, weights, 0)
    torch.testing.assert_close(out.float(), reference, rtol=0.05, atol=0.05)
    empty = reference_experts(x[:0], w13, w2, IDS[:0], weights[:0], 0)
    assert empty.shape == (0, HIDDEN)


def hf_moe_config(norm_topk_prob: bool, **overrides: object) -> object:
    from transformers import Qwen3MoeConfig

    fields = dict(hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE, num_experts=NUM_EXPERTS,
                  num_experts_per_tok=2, norm_topk_prob=norm_topk_prob)
    return Qwen3MoeConfig(**{**fields, **overrides})


def our_config(norm_topk_prob: bool, num_experts_per_tok: int = 2) -> ModelConfig:
    return ModelConfig(architecture="qwen3_moe", vocab_size=64, hidden_size=HIDDEN, intermediate_size=64,
                       num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
                       max_position_embeddings=64, tie_word_embeddings=False, num_experts=NUM_EXPERTS,
                       num_experts_per_tok=num_experts_per_tok, moe_intermediate_size=INTERMEDIATE,
                       norm_topk_prob=norm_topk_prob)


class Holder(nn.Module):
    """Puts a block at `layer.mlp`, so that checkpoint names reach it as they reach a model's."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.layer = nn.Module()
        self.layer.mlp = block


def matching_blocks(norm_topk_prob: bool, num_experts_per_tok: int = 2) -> tuple[SparseMoeBlock, nn.Module]:
    """Our block and transformers' eager one with the same random weights, loaded by HF's (fused) names."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hf_config = hf_moe_config(norm_topk_prob, num_experts_per_tok=num_experts_per_tok)
    hf_config._experts_implementation = "eager"
    hf = Qwen3MoeSparseMoeBlock(hf_config).eval()
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in hf.parameters():
            param.copy_(3 * torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5)
    ours = SparseMoeBlock(our_config(norm_topk_prob, num_experts_per_tok))
    holder = Holder(ours)
    for name, tensor in hf.state_dict().items():
        load_named_tensor(holder, f"layer.mlp.{name}", tensor)
    return ours, hf


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_is_transformers(norm_topk_prob: bool, dtype: torch.dtype) -> None:
    """The same experts; the weights in float32, which rounded to the activation dtype (where transformers
    rounds them) are transformers' weights."""
    ours, hf = matching_blocks(norm_topk_prob)
    ours.to(dtype)
    hf.to(dtype)
    hidden = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(6)).to(dtype)
    with torch.inference_mode():
        weights, ids = ours.route(hidden)
        _, hf_weights, hf_ids = hf.gate(hidden)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids, hf_ids)
    assert torch.equal(weights.to(dtype), hf_weights)
    if norm_topk_prob:
        torch.testing.assert_close(weights.sum(-1), torch.ones(40))
    assert len(ids.unique()) >= 4  # not degenerate: several experts chosen


@pytest.mark.parametrize(("norm_topk_prob", "top_k"), [(True, 2), (False, 2), (False, 3)])
def test_block_is_transformers_block_bit_for_bit(norm_topk_prob: bool, top_k: int) -> None:
    """Float32, against transformers' eager experts: norm(x + residual) through the block, same bits
    (its default grouped_mm experts sum top-k > 2 terms in another order: close)."""
    ours, hf = matching_blocks(norm_topk_prob, top_k)
    norm = RMSNorm(HIDDEN)
    generator = torch.Generator().manual_seed(7)
    x, residual = torch.randn(2, 40, HIDDEN, generator=generator)
    with torch.inference_mode():
        out, total = ours(x, residual, norm)
        reference = hf(norm(x + residual)[None])[0]
        hf.experts.config._experts_implementation = "grouped_mm"
        grouped = hf(norm(x + residual)[None])[0]
    assert torch.equal(total, x + residual)
    assert torch.equal(out, reference)
    torch.testing.assert_close(out, grouped)


def test_block_calls_the_kernel_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel swapped into KERNELS["experts"] gets the contract's arguments."""
    ours, _ = matching_blocks(True)
    seen = {}

    def kernel(x, w13, w2, ids, weights, first_expert):  # type: ignore[no-untyped-def]
        seen.update(shapes=(x.shape, w13.shape, w2.shape), dtypes=(ids.dtype, weights.dtype), first=first_expert)
        return reference_experts(x, w13, w2, ids, weights, first_expert)

    monkeypatch.setitem(KERNELS, "experts", kernel)
    ours(torch.randn(5, HIDDEN), torch.randn(5, HIDDEN), RMSNorm(HIDDEN))
    shapes = ((5, HIDDEN), (NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN), (NUM_EXPERTS, HIDDEN, INTERMEDIATE))
    assert seen == dict(shapes=shapes, dtypes=(torch.int64, torch.float32), first=0)


def test_config_from_hf() -> None:
    hf = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=INTERMEDIATE, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[2])
    config = ModelConfig.from_hf_dict(hf)
    assert (config.architecture, config.has_qk_norm) == ("qwen3_moe", True)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, INTERMEDIATE)
    assert config.norm_topk_prob and config.mlp_only_layers == (2,)
    assert [config.is_moe_layer(i) for i in range(4)] == [True, True, False, True]
    # the Hub's configs say num_experts; transformers' defaults fill what is absent (norm_topk_prob False)
    hub = {k: v for k, v in hf.items() if k not in ("num_local_experts", "norm_topk_prob", "mlp_only_layers")}
    config = ModelConfig.from_hf_dict({**hub, "num_experts": 16, "decoder_sparse_step": 2})
    assert config.num_experts == 16 and not config.norm_topk_prob
    assert [config.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    dense = ModelConfig.from_hf_dict({**hf, "model_type": "qwen3"})
    assert dense.num_experts == 0 and not any(dense.is_moe_layer(i) for i in range(4))


@pytest.mark.parametrize(("change", "message"), [
    (dict(num_experts_per_tok=7), "num_experts_per_tok 7 must be between 1 and num_experts 6"),
    (dict(num_experts_per_tok=0), "num_experts_per_tok 0 must be between 1 and num_experts 6"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size 0 must be positive"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step 0 must be at least 1"),
    (dict(mlp_only_layers=(0, 3)), r"mlp_only_layers \[0, 3\]: \[3\] outside the 1 layers"),
    (dict(architecture="qwen3"), "num_experts: architecture 'qwen3' has no experts"),
])
def test_config_errors_name_the_field(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}"):
        dataclasses.replace(our_config(True), **change)


def as_rank(monkeypatch: pytest.MonkeyPatch, rank: int, world_size: int) -> None:
    monkeypatch.setattr(distributed, "_state", distributed.ParallelState(rank, world_size, None))  # type: ignore[arg-type]


def test_experts_split_whole_over_the_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    as_rank(monkeypatch, 1, 3)
    experts = Experts(NUM_EXPERTS, HIDDEN, INTERMEDIATE)
    assert (experts.first_expert, experts.num_local_experts) == (2, 2)
    assert experts.gate_up_proj.shape == (2, 2 * INTERMEDIATE, HIDDEN)
    assert len(experts.gate_up_proj.shard_ids) == 2 * NUM_EXPERTS  # every expert's shards, not only its own


def test_build_fails_when_experts_do_not_divide(monkeypatch: pytest.MonkeyPatch) -> None:
    config = dataclasses.replace(our_config(True), num_heads=4, num_kv_heads=4)
    as_rank(monkeypatch, 0, 4)
    with pytest.raises(ValueError, match="^tensor_parallel_size 4 does not divide num_experts 6"):
        build_model(config, get_attention_backend("torch"))


def test_startup_check_names_the_experts(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path, "qwen3_moe", num_layers=1, num_experts=6)
    with pytest.raises(ValueError, match="^tensor_parallel_size: 6 experts .num_experts. do not divide over 4 ranks"):
        check_tensor_parallel(WorkerConfig(model=str(path), tensor_parallel_size=4, device="cpu"))
