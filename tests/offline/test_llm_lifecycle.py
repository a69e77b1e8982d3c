"""An LLM frees what it holds on close() (or at the end of its `with` block), so that one process
builds several in a row: on CPUs the model is gone, on a GPU its memory is back."""
from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch

from common import SamplingParams
from offline import LLM
from tests.tiny_models import make_tiny_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3, 250], list(range(40, 90))]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("lifecycle"), "qwen3")


def test_three_llms_in_a_row_each_generate_and_drop_their_model(model: Path) -> None:
    outputs = []
    for _ in range(3):
        with LLM(str(model), block_size=16, num_kv_blocks=64, device="cpu") as llm:
            outputs.append([r["token_ids"] for r in llm.generate(PROMPTS, GREEDY, use_tqdm=False)])
            weights = weakref.ref(llm.worker.runner.model)  # type: ignore[union-attr]
        assert weights() is None
        with pytest.raises(RuntimeError, match="closed"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        llm.close()  # again: a no-op
    assert all(len(tokens) == GREEDY.max_tokens for tokens in outputs[0])
    assert outputs[0] == outputs[1] == outputs[2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_three_llms_in_a_row_on_a_gpu_give_their_memory_back(tmp_path: Path) -> None:
    """Each takes the default budget (most of the GPU) for its KV cache, so the next one starts only
    if the last one's memory came back. (4 MiB blocks: a few tens of thousands fill an H200.)"""
    model = make_tiny_checkpoint(tmp_path, "qwen3", num_heads=8, num_kv_heads=8, head_dim=128, hidden_size=256,
                                 num_layers=4)
    baseline = torch.cuda.memory_allocated()
    for _ in range(3):
        with LLM(str(model), device="cuda", block_size=256, max_num_seqs=16, max_num_batched_tokens=512) as llm:
            assert len(llm.generate(PROMPTS, GREEDY, use_tqdm=False)[1]["token_ids"]) == GREEDY.max_tokens
            assert torch.cuda.memory_allocated() - baseline > 2**30
        # A little may stay: cuBLAS workspaces, the sampler's compiled kernels.
        assert torch.cuda.memory_allocated() - baseline < 256 * 2**20
