"""Swaps a loaded GGUF model's linears for weight-only quantized ones on the CPU (`cpu_weight_format`).

The float32 model is loaded first, as on every other path; then each projection whose GGUF tensors are
Q4_0/Q4_1 gets an Int4Linear built from the file's own codes (no re-quantization). The output head gets
an Int8Head: per-row int8 logits pick the candidates, whose logits are then recomputed in float32 (int8
logits alone agreed with the float32 head's top-1 at only 97 % of positions).
The float32 layers stay inside the wrappers for prefill-sized steps.

MoE models: the attention projections (and the MLPs of dense layers) go int4 as above; the sparse
layers' experts and routers stay dense float32 (the expert kernel reads the stacked 3-D experts, which
have no int4 form here), so a MoE model's weights shrink far less than a dense one's.
"""
from __future__ import annotations

import logging

from torch import nn

from common.formats.gguf_file import GGUFFile
from worker_service.loader.gguf_int4 import Int4Groups, read_int4_groups
from worker_service.loader.quantized_cpu import Int4Linear, Int8Head
from worker_service.models.config import ModelConfig

logger = logging.getLogger(__name__)


def _projection_sources(config: ModelConfig) -> dict[str, list[tuple[str, int]]]:
    """Our fused projection -> its GGUF tensors (suffix, heads to unpermute), in shard order."""
    is_permuted = config.architecture == "llama"  # llama.cpp interleaves llama's q/k rows only
    return {
        "self_attn.qkv_proj": [("attn_q", config.num_heads * is_permuted),
                               ("attn_k", config.num_kv_heads * is_permuted), ("attn_v", 0)],
        "self_attn.o_proj": [("attn_output", 0)],
        "mlp.gate_up_proj": [("ffn_gate", 0), ("ffn_up", 0)],
        "mlp.down_proj": [("ffn_down", 0)],
    }


def quantize_gguf_model_for_cpu(model: nn.Module, gguf: GGUFFile, config: ModelConfig) -> None:
    """Replaces, in place, every projection stored as Q4_0/Q4_1 by an Int4Linear, and the head by an Int8Head."""
    num_int4 = 0
    for index, layer in enumerate(model.model.layers):
        for path, sources in _projection_sources(config).items():
            if path.startswith("mlp.") and config.is_moe_layer(index):
                continue  # a sparse layer: its experts stay float32 (see the module docstring)
            parts = [read_int4_groups(gguf, f"blk.{index}.{suffix}.weight", heads) for suffix, heads in sources]
            if any(part is None for part in parts):
                continue  # some shard is not 4-bit (e.g. a Q6_K ffn_down): keep the float32 layer
            parent_path, name = path.rsplit(".", 1)
            parent = layer.get_submodule(parent_path)
            setattr(parent, name, Int4Linear(getattr(parent, name), Int4Groups.concat_rows(parts)))  # type: ignore[arg-type]
            num_int4 += 1
    model.lm_head = Int8Head(model.lm_head)
    logger.info("CPU weights: %d projections int4 (from the GGUF's 4-bit blocks), output head int8", num_int4)
