"""The whole model on a GPU (Triton attention, CUDA graphs) against transformers on tiny random
checkpoints (dense, and a mixture of experts): greedy token-exact in float32; in bfloat16,
teacher-forced logits within 2e-2 relative error and top-1 agreement on at least 99 % of positions,
through prefill and through graph-replayed decode steps. The flash-attn backend (where flash-attn-4 is
installed) in the same bf16 check, eager so that its prefills are FlashAttention's."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from common import SamplingParams
from common.contract.config import WorkerConfig
from tests.tiny_models import hf_greedy_generate, make_tiny_checkpoint
from tests.worker_service.triton_runtime import FLASH_ATTN_INSTALLED

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# Tied embeddings, as Qwen3-0.6B has: the residual stream then makes a random model's next-token
# distribution peaked, so that its top-1 is not a near-tie that bf16 rounding alone would flip.
MODELS = {
    "qwen3-d64-gqa4": dict(arch="qwen3", num_heads=8, num_kv_heads=2, head_dim=64, hidden_size=256, tie=True),
    "qwen3-d128-gqa2": dict(arch="qwen3", num_heads=4, num_kv_heads=2, head_dim=128, hidden_size=256, tie=True),
    "llama-d64-mha": dict(arch="llama", num_heads=4, num_kv_heads=4, head_dim=64, hidden_size=256, tie=True),
    "llama-d128-gqa4": dict(arch="llama", num_heads=8, num_kv_heads=2, head_dim=128, hidden_size=512, tie=True),
    # The fused expert kernels (layers/triton_moe) in eager steps and inside the decode and prefill graphs.
    "qwen3moe-e16-top4": dict(arch="qwen3_moe", num_heads=8, num_kv_heads=2, head_dim=64, hidden_size=256, tie=True,
                              num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128),
}
NUM_NEW_TOKENS = 64
needs_flash_attn = pytest.mark.skipif(not FLASH_ATTN_INSTALLED, reason="needs flash-attn-4")


@pytest.fixture(scope="module", params=list(MODELS))
def checkpoint(request, tmp_path_factory) -> Path:
    spec = dict(MODELS[request.param])
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), spec.pop("arch"), seed=7, **spec)


def prompts(vocab_size: int = 512) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(5, 150))] for _ in range(10)]


def hf_greedy(path: Path, batch: list[list[int]]) -> list[list[int]]:
    return hf_greedy_generate(path, batch, NUM_NEW_TOKENS)


@pytest.mark.parametrize(("enforce_eager", "attention_backend"),
                         [(False, "auto"), (True, "auto"), pytest.param(True, "flash-attn", marks=needs_flash_attn)],
                         ids=["graphs", "eager", "flash-attn-eager"])
def test_float32_greedy_is_token_exact(checkpoint: Path, enforce_eager: bool, attention_backend: str) -> None:
    """flash-attn in float32: FlashAttention has no float32 kernels, so the Triton ones, still exact."""
    from offline import LLM

    batch = prompts()
    with LLM(str(checkpoint), device="cuda", dtype="float32", block_size=16, num_kv_blocks=512, max_num_seqs=16,
             max_num_batched_tokens=512, enforce_eager=enforce_eager, attention_backend=attention_backend) as llm:
        results = llm.generate(batch, SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True),
                               use_tqdm=False)
    assert [r["token_ids"] for r in results] == hf_greedy(checkpoint, batch)


def test_one_sequence_prefills_through_their_graph_token_exact(checkpoint: Path, monkeypatch) -> None:
    """A lone request's prefill replays a padded prefill graph (the repeated prompt: only its
    uncached tail), and the tokens stay transformers' own in float32."""
    from offline import LLM
    from worker_service.runtime.cuda_graphs import PrefillGraphs

    replayed: list[int] = []
    run = PrefillGraphs.run

    def counting_run(self, input_ids, positions, metadata):
        replayed.append(input_ids.shape[0])
        return run(self, input_ids, positions, metadata)

    monkeypatch.setattr(PrefillGraphs, "run", counting_run)
    batch = prompts()[:4]
    batch.append(batch[1])  # 35 tokens: 32 cached, 3 computed
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    with LLM(str(checkpoint), device="cuda", dtype="float32", block_size=16, num_kv_blocks=512, max_num_seqs=16,
             max_num_batched_tokens=512) as llm:
        results = [llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"] for prompt in batch]
    assert len(replayed) == len(batch)
    assert replayed[:4] == [len(prompt) for prompt in batch[:4]]
    assert replayed[4] < len(batch[4])  # the cached prefix is not computed again
    assert results == hf_greedy(checkpoint, batch)


def teacher_forced_logits(checkpoint: Path, tokens: list[int], prompt_len: int,
                          attention_backend: str = "auto") -> torch.Tensor:
    """Our bf16 logits at positions prompt_len-1 .. len-2: the prompt in two prefill chunks, then
    one decode step per token, replayed through the CUDA graph (eager steps for flash-attn)."""
    from worker_service.layers import fused_kernels
    from worker_service.runtime.batch import ScheduledChunk, build_model_input
    from worker_service.runtime.model_runner import ModelRunner
    from worker_service.runtime.sequence_state import WorkerSequence

    eager = attention_backend == "flash-attn"
    config = WorkerConfig(model=str(checkpoint), device="cuda", dtype="bfloat16", block_size=16, num_kv_blocks=64,
                          max_num_seqs=4, max_num_batched_tokens=512, attention_backend=attention_backend,
                          enforce_eager=eager)
    fused_kernels.enable()  # as a worker sets at start
    runner = ModelRunner(config)
    runner.init_cache(64)
    assert bool(runner.graphs) != eager
    blocks = list(range(64))
    random.Random(0).shuffle(blocks)
    blocks = blocks[:-(-len(tokens) // 16)]
    state = WorkerSequence(seq_id=1, block_table=blocks, num_computed_tokens=0, num_tokens=prompt_len,
                           num_prompt_tokens=prompt_len, sampling=SamplingParams())
    half = prompt_len // 2
    forward = lambda chunk: runner.forward_logits(build_model_input([chunk], 16, runner.device))  # noqa: E731
    forward(ScheduledChunk(state, tokens[:half], samples=False))
    state.num_computed_tokens = half
    logits = [forward(ScheduledChunk(state, tokens[half:prompt_len], True))]
    state.num_computed_tokens = prompt_len
    for position in range(prompt_len, len(tokens) - 1):
        state.num_tokens = position + 1
        logits.append(forward(ScheduledChunk(state, [tokens[position]], True)))
        state.num_computed_tokens = position + 1
    return torch.cat(logits).float().cpu()


@pytest.mark.parametrize("attention_backend", ["auto", pytest.param("flash-attn", marks=needs_flash_attn)])
def test_bfloat16_teacher_forced_logits_track_float32(checkpoint: Path, attention_backend: str) -> None:
    """Over eight prompts and their 64-token greedy continuations (512 positions in all)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    batch = prompts()[:8]
    ours_all, reference_all = [], []
    for prompt, continuation in zip(batch, hf_greedy(checkpoint, batch), strict=True):
        tokens = prompt + continuation
        with torch.no_grad():
            reference_all.append(hf(torch.tensor([tokens])).logits[0, len(prompt) - 1:-1])
        ours_all.append(teacher_forced_logits(checkpoint, tokens, len(prompt), attention_backend))
    ours, reference = torch.cat(ours_all), torch.cat(reference_all)
    assert ours.shape == reference.shape == (8 * NUM_NEW_TOKENS, reference.shape[-1])
    relative_error = (ours - reference).norm() / reference.norm()
    assert relative_error < 2e-2, f"relative error {relative_error:.3e}"
    agreement = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
    assert agreement >= 0.99, f"top-1 agreement {agreement:.3f}"
