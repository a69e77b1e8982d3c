"""The float32 weights of the batch-invariant CPU products, laid out column-major.

cpu_products multiplies W in chunks of 64 of its K columns. Row-major ([N, K] as stored), a chunk is 64
floats out of every row, 4 * K bytes apart, and MKL's batched product read them at a fraction of memory
bandwidth: a float32 decode step of the default model took 88 ms against the default kernels' 35 (a
decode step reads every weight once, so it runs at the speed weights are read). Column-major (W^T
contiguous, the same [N, K] tensor to everything that uses it), each chunk is one contiguous block:
68 ms (bench/deterministic_cpu.py --weight-format float32, 2 cores). The bits do not change (tested).

The output heads that an Int8Head wraps keep their layout: its exact pass gathers 32 of their rows a
token, which column-major would scatter over the whole weight (and the embedding tied to such a head
shares its weight).
"""
from __future__ import annotations

from torch import nn

from worker_service.layers.embedding import VocabParallelWeight
from worker_service.layers.linear import LinearBase
from worker_service.loader.quantized_cpu import Int4Linear, Int8Head


def prepare(model: nn.Module) -> None:
    """Lays out, in place, the CPU float32 weights of model's linears and output head column-major
    (each parameter once, a tied one too); the values stay the same."""
    keep = {id(param) for module in model.modules() if isinstance(module, Int8Head)
            for param in module.dense.parameters()}
    unused = {id(param) for module in model.modules() if isinstance(module, Int4Linear)
              for param in module.dense.parameters()}  # int4 serves every step under --deterministic
    done: set[int] = set()
    for module in model.modules():
        if not isinstance(module, LinearBase | VocabParallelWeight):
            continue
        weight = module.weight
        if id(weight) in keep | unused | done or weight.device.type != "cpu" or weight.ndim != 2:
            continue
        done.add(id(weight))
        weight.data = weight.data.t().contiguous().t()
