"""Compiles every Triton kernel of the worker for an H100/H200 (sm_90) on a machine without a GPU:
Triton's front end, its MLIR passes, LLVM and ptxas all run, so an error that only the real compiler
reports (the interpreter runs kernels as Python) shows up here. `python -m
tests.worker_service.kernel_compilation` prints one line per compiled variant.

Run it with TRITON_INTERPRET unset: under the interpreter the kernels are not compilable objects.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

SM90 = ("cuda", 90, 32)


@dataclass
class Variant:
    """One compiled specialisation: pointer element types (others bf16), float scalars (others
    int32), the constexprs, the launch options, and the arguments a launch passes as multiples of 16
    (Triton specialises on that, and only then can it make 16-byte loads)."""

    name: str
    kernel: object
    constexprs: dict[str, object]
    pointers: dict[str, str] = field(default_factory=dict)
    floats: tuple[str, ...] = ()
    int64s: tuple[str, ...] = ()
    options: dict[str, object] = field(default_factory=dict)
    divisible_by_16: tuple[str, ...] = ()

    def attrs(self) -> dict[tuple[int, ...], list[list[object]]]:
        return {(index,): [["tt.divisibility", 16]] for index, name in enumerate(self.kernel.arg_names)
                if name in self.divisible_by_16}

    def signature(self) -> dict[str, str]:
        types = {}
        for name in self.kernel.arg_names:
            if name in self.constexprs:
                types[name] = "constexpr"
            elif name.endswith("_ptr"):
                types[name] = "*" + self.pointers.get(name, "bf16")
            elif name in self.floats:
                types[name] = "fp32"
            else:
                types[name] = "i64" if name in self.int64s else "i32"
        return types


def variants() -> list[Variant]:
    """The specialisations Qwen3-0.6B (16 q / 8 KV heads of 128, q/k norms) and a Llama-like model
    (no q/k norm) launch with in bf16, block size 256, with a bf16 and with an fp8 KV cache."""
    from worker_service.attention.triton_decode import (
        DECODE_BLOCK_N,
        DECODE_NUM_STAGES,
        _decode_kernel,
        decode_num_warps,
    )
    from worker_service.attention.triton_prefill import _prefill_kernel
    from worker_service.attention.triton_rope_store import _rope_store_kernel
    from worker_service.attention.triton_store_kv import _store_kv_kernel
    from worker_service.layers.triton_activation import _silu_and_mul_kernel
    from worker_service.layers.triton_norm import _rms_norm_kernel
    from worker_service.layers.triton_skinny_matmul import _config, _skinny_matmul_kernel, _tile_constexprs
    from worker_service.sampling.fused_sampling import _gumbel_chunk_kernel, _reduce_chunks_kernel

    cache = dict(BLOCK_SIZE=256, HEAD_DIM=128)
    tables = {"block_tables_ptr": "i32", "seq_lens_ptr": "i32"}
    # The KV cache in the model dtype, and in fp8 (kv_cache_dtype="fp8": e4m3; decode reads it as fp16).
    kv_types = {False: {}, True: {"k_cache_ptr": "fp8e4nv", "v_cache_ptr": "fp8e4nv", "k_scale_ptr": "fp32",
                                  "v_scale_ptr": "fp32"}}
    # As the worker launches it: 16-byte aligned tensors, strides of whole head vectors, an fp8 cache's
    # scales head by head within a block (kv_quant.allocate_scales: unit token stride).
    decode_strides = ("stride_q_tok", "stride_q_head", "stride_k_block", "stride_k_tok", "stride_k_head",
                      "stride_v_block", "stride_v_tok", "stride_v_head", "stride_o_tok", "stride_o_head",
                      "stride_po_seq", "stride_po_head")
    pointers = tuple(name for name in _decode_kernel.arg_names if name.endswith("_ptr"))
    fp8_scales = {False: {}, True: {"stride_s_tok": 1}}
    result = [
        Variant(f"decode split={is_split} fp8={fp8}", _decode_kernel,
                dict(cache, GROUP=2, BLOCK_H=16, BLOCK_N=DECODE_BLOCK_N, IS_SPLIT=is_split, BLOCK_SPLITS=4,
                     DOT_PRECISION="tf32", IS_FP8=fp8, WIDEN_V_IN_REGISTERS=fp8, HAS_ORDER=True, PDL=True,
                     **fp8_scales[fp8]),
                dict(tables, order_ptr="i32", partial_out_ptr="fp32", partial_lse_ptr="fp32", counters_ptr="i32",
                     **kv_types[fp8]),
                ("scale_log2",),
                options=dict(num_warps=decode_num_warps(fp8), num_stages=DECODE_NUM_STAGES, launch_pdl=True),
                divisible_by_16=pointers + decode_strides + (("stride_s_block", "stride_s_head") if fp8 else ()))
        for fp8 in (False, True) for is_split in (False, True)
    ]
    for fp8 in (False, True):
        result += [
            *(Variant(f"prefill fp8={fp8} one_pass={one_pass} block_m={block_m}", _prefill_kernel,
                      dict(cache, GROUP=2, BLOCK_M=block_m, BLOCK_Q=block_m // 2, BLOCK_N=64, DOT_PRECISION="tf32",
                           IS_FP8=fp8, ONE_PASS=one_pass),
                      dict(tables, query_start_loc_ptr="i32", **kv_types[fp8]), ("scale_log2",),
                      options=dict(num_warps=8 if block_m == 128 else 4, num_stages=3))
              # one_pass (--deterministic) also serves decode batches: 16-row tiles
              for one_pass, block_m in ((False, 128), (True, 128), (True, 16))),
            Variant(f"store kv fp8={fp8}", _store_kv_kernel, dict(cache, NUM_KV_HEADS=8, BLOCK_HEADS=8, IS_FP8=fp8),
                    {"slot_mapping_ptr": "i64", **kv_types[fp8]}),
        ]
    result += [
        Variant("silu and mul", _silu_and_mul_kernel, dict(BLOCK=1024, PDL=True), options=dict(launch_pdl=True)),
        *(Variant(f"rms norm residual={residual}", _rms_norm_kernel, dict(HAS_RESIDUAL=residual, BLOCK=1024),
                  floats=("eps",), options=dict(num_warps=4)) for residual in (False, True)),
        Variant("gumbel chunk", _gumbel_chunk_kernel, dict(BLOCK=4096, FAST_LOG=True),
                dict(inv_temperatures_ptr="fp32", partial_value_ptr="fp32", partial_column_ptr="i64"),
                int64s=("seed",)),
        Variant("reduce chunks", _reduce_chunks_kernel, dict(BLOCK_CHUNKS=32),
                dict(partial_value_ptr="fp32", partial_column_ptr="i64", token_ids_ptr="i64", values_ptr="fp32"),
                options=dict(num_warps=1)),
    ]
    # Qwen3-0.6B's decode projections (gate_up, down with K past its block, qkv with a bias) at 1, 4 and
    # 16 rows: the CUDA-core kernel (one row) and the tensor-core one (4 and 16 rows, both tiles); with
    # the norm in the prologue (1: without a residual, 2: with one) as qkv_proj and gate_up_proj run.
    # As launched: 16-byte aligned tensors, row strides and sizes multiples of 16, which Triton specialises
    # on (without it a one-row weight tile compiles to 64 two-byte loads a thread instead of 8 of 16 bytes).
    skinny_aligned = tuple(name for name in _skinny_matmul_kernel.arg_names
                           if name.endswith("_ptr") or name.startswith("stride") or name in ("N", "K"))

    def skinny(name: str, rows: int, n: int, k: int, **constexprs: object) -> Variant:
        config = _config(rows, n, k)
        return Variant(name, _skinny_matmul_kernel, dict(**constexprs, **_tile_constexprs(config, rows, k), PDL=True),
                       floats=("eps",), divisible_by_16=skinny_aligned,
                       options=dict(num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=True))

    for rows, n, k, bias, norm in ((1, 6144, 1024, False, 0), (1, 1024, 3072, False, 0), (4, 4096, 1024, True, 0),
                                   (16, 1024, 2048, False, 0), (1, 6144, 1024, False, 2), (1, 4096, 1024, True, 1),
                                   (4, 6144, 1024, False, 2)):
        result.append(skinny(f"skinny matmul rows={rows} n={n} k={k} norm={norm}", rows, n, k, HAS_BIAS=bias,
                             NORM=norm, GATED=False))
    for rows in (1, 4, 16):  # down_proj with SiLU-and-mul in its prologue, as the MLP runs it
        result.append(skinny(f"skinny matmul rows={rows} n=1024 k=3072 gated", rows, 1024, 3072, HAS_BIAS=False,
                             NORM=0, GATED=True))
    result += invariant_product_variants()
    result += moe_variants()
    # A token's work in one program (a bf16 cache past SPLIT_MAX_TOKENS), or split: two programs of 8 q
    # heads and one for k and v (an fp8 cache, or a few tokens).
    whole = dict(Q_HEADS_PER_PROGRAM=16, KV_APART=False, BLOCK_HEADS=16)
    split = dict(Q_HEADS_PER_PROGRAM=8, KV_APART=True, BLOCK_HEADS=8)
    for has_norm, fp8, parts in ((True, False, whole), (False, False, whole), (True, False, split),
                                 (True, True, split)):
        result.append(Variant(
            f"rope+store norms={has_norm} fp8={fp8} split={parts['KV_APART']}", _rope_store_kernel,
            dict(cache, **parts, NUM_HEADS=16, NUM_KV_HEADS=8, BLOCK_KV_HEADS=8, HAS_Q_NORM=has_norm,
                 HAS_K_NORM=has_norm, IS_FP8=fp8, PDL=True),
            dict(positions_ptr="i64", cos_ptr="fp32", sin_ptr="fp32", slot_mapping_ptr="i64", **kv_types[fp8]),
            ("eps",), options=dict(num_warps=4, enable_fp_fusion=False, launch_pdl=True)))
    return result


def moe_variants() -> list[Variant]:
    """The fused expert kernels (layers/triton_moe) at Qwen3-30B-A3B's 128 experts in bf16: the align
    kernel, and both grouped products under every configuration moe_config picks and --deterministic's."""
    from worker_service.layers.triton_moe import (
        ALIGN_CHUNK,
        BLOCKS_CHUNK,
        COMBINE_BLOCK,
        INVARIANT_CONFIG,
        _align_kernel,
        _combine_kernel,
        _grouped_kernel,
        moe_config,
    )

    ints = {"ids_ptr": "i64", "sorted_ptr": "i32", "block_experts_ptr": "i32", "cursor_ptr": "i32"}
    result = [Variant("moe align", _align_kernel, dict(BLOCK_M=16, NUM_BINS=256, CHUNK=ALIGN_CHUNK,
                                                       BLOCKS_CHUNK=BLOCKS_CHUNK), ints, options=dict(num_warps=8)),
              Variant("moe combine", _combine_kernel, dict(TOP_K=8, BLOCK=COMBINE_BLOCK), {"ids_ptr": "i64"})]
    configs = {moe_config(entries, 128) for entries in (8, 2048, 8192, 32768)} | {INVARIANT_CONFIG}
    for config in sorted(configs):
        for gate_up in (True, False):
            result.append(Variant(
                f"moe grouped gate_up={gate_up} {config}", _grouped_kernel,
                dict(TOP_K=8, GATE_UP=gate_up, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                     BLOCK_K=config.block_k, DOT_PRECISION="tf32"),
                {"sorted_ptr": "i32", "block_experts_ptr": "i32", "weights_ptr": "fp32"},
                options=dict(num_warps=config.num_warps, num_stages=config.num_stages)))
    return result


def invariant_product_variants() -> list[Variant]:
    """--deterministic's products (invariant/triton_products) as Qwen3-0.6B launches them in bf16: the
    chain (qkv at decode and prefill sizes), the segmented product one-pass and as partials, their sum."""
    import torch

    from worker_service.invariant.triton_products import (
        _matmul_kernel,
        _reduction_constexprs,
        _sum_segments_kernel,
        chain_config,
        segmented_config,
    )

    result = []
    for name, chain, partials, config in (("chain 256 rows", True, False, chain_config(256, 4096)),
                                          ("chain 4096 rows", True, False, chain_config(4096, 4096)),
                                          ("segmented 256 rows", False, False, segmented_config(256, torch.bfloat16)),
                                          ("segment partials 16 rows", False, True,
                                           segmented_config(16, torch.bfloat16)._replace(num_warps=4))):
        result.append(Variant(
            f"invariant product {name}", _matmul_kernel,
            dict(HAS_BIAS=False, CHAIN=chain, PARTIALS=partials, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                 **_reduction_constexprs(1024 if chain else 128, torch.bfloat16)),
            {"out_ptr": "fp32"} if partials else {},
            options=dict(num_warps=config.num_warps, num_stages=config.num_stages)))
    result.append(Variant("invariant sum of segments", _sum_segments_kernel, dict(HAS_BIAS=False, BLOCK=1024),
                          {"partials_ptr": "fp32"}, options=dict(num_warps=4)))
    return result


def compile_all() -> list[str]:
    """Compiles every variant for sm_90; returns one line per variant (raises on the first error)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    lines = []
    for variant in variants():
        source = ASTSource(fn=variant.kernel, signature=variant.signature(), constexprs=variant.constexprs,
                           attrs=variant.attrs())
        compiled = triton.compile(source, target=GPUTarget(*SM90), options=variant.options)
        ptx = compiled.asm["ptx"]
        copies = [line for line in ptx.splitlines() if "cp.async.cg.shared.global" in line]
        wide_loads = len(re.findall(r"ld\.global[\w.]*\.v4\.b32", ptx))
        lines.append(f"{variant.name}: {compiled.metadata.name}, {len(compiled.asm['cubin'])} bytes of cubin, "
                     f"{compiled.metadata.shared} bytes of shared memory, {wide_loads} 16-byte loads, "
                     f"{sum(', 0x10,' in line for line in copies)} of {len(copies)} async copies 16 bytes, "
                     f"{ptx.count('atom.global.gpu.acq_rel')} acq_rel atomics, "
                     f"{ptx.count('griddepcontrol.wait')} griddepcontrol.wait")
    return lines


if __name__ == "__main__":
    print("\n".join(compile_all()))
