"""Where a decode layer's time goes at a few sequences, by leaving kernels out of the chain.

A decode step of the random Qwen3-0.6B is 28 times one chain of six kernels: the qkv product with the
norm before it, the q/k norms with rotary and the K/V store, the split decode attention, the o product,
the gate/up product with its norm, the down product with SiLU-and-mul. Under programmatic dependent
launch the kernels overlap, so a profiler's per-kernel times (each includes its wait for the previous
one) do not add up to the step. Here a chain of --layers layers (each its own weights and cache, so
nothing is read from L2) is captured in a CUDA graph and replayed: whole, with one kind of kernel left
out (what that kernel costs the chain), and with only one kind kept (what it costs on its own). The
floor beside it: the weights and the K/V read once at --bandwidth.

    python bench/decode_chain.py [--batch 1] [--context 768] [--layers 28] [--without-pdl] [--sweep-products]
                                [--sweep-attention] [--num-splits N] [--decode-block-n N]

--sweep-products times each product alone in the chain with other tilings (SkinnyConfig) beside the one
triton_skinny_matmul._config picks: the tiling under PDL, where a product's weights load before it waits.
--sweep-attention times the attention alone and the whole chain at other split counts and tile widths
(--num-splits and --decode-block-n set the attention of the other runs).

--smoke runs the chain once on tiny shapes without timing (on the CPU through Triton's interpreter:
tests/worker_service/test_bench_decode_chain.py), so that the script is known to run before device time
is spent on it.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402

from bench.memory_floor import attention_params, dense_mlp_params, kv_bytes_per_token  # noqa: E402
from bench.random_checkpoint import QWEN3_0_6B  # noqa: E402
from worker_service.layers.rotary import RotaryEmbedding  # noqa: E402
from worker_service.layers.triton_skinny_matmul import (  # noqa: E402
    SkinnyConfig,
    _config,
    skinny_linear,
    skinny_norm_linear,
    skinny_silu_linear,
)
from worker_service.models.config import ModelConfig  # noqa: E402

KINDS = ("qkv", "rope+store", "attention", "o", "gate_up", "down")
BLOCK_SIZE = 256  # the worker's default KV block
TINY = QWEN3_0_6B | {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "head_dim": 32}
TINY_BLOCK_SIZE = 16


class Layer:
    """One layer's weights and paged cache, and its chain of kernels with some kinds left out."""

    def __init__(self, config: ModelConfig, block_size: int, batch: int, context: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        def weight(rows: int, columns: int) -> torch.Tensor:
            return torch.randn(rows, columns, device=device).div_(columns ** 0.5).to(dtype)

        c = config
        self.config = c
        shapes = product_shapes(c)
        self.w_qkv, self.w_o, self.w_gate_up, self.w_down = (weight(*shapes[kind])
                                                             for kind in ("qkv", "o", "gate_up", "down"))
        self.norms = [torch.ones(c.hidden_size, dtype=dtype, device=device) for _ in range(2)]
        self.head_norms = [torch.ones(c.head_dim, dtype=dtype, device=device) for _ in range(2)]
        cache_shape = (batch * blocks_per_sequence(context, block_size), block_size, c.num_kv_heads, c.head_dim)
        self.k_cache = torch.randn(cache_shape, device=device).to(dtype)
        self.v_cache = torch.randn(cache_shape, device=device).to(dtype)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor, steps: StepInputs, skipped: frozenset[str],
                tilings: dict[str, SkinnyConfig]) -> tuple[torch.Tensor, torch.Tensor]:
        from worker_service.attention.triton_decode import paged_decode
        from worker_service.attention.triton_rope_store import rope_and_store

        c = self.config
        batch = hidden.shape[0]
        q_width, kv_width = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        run = _runner(skipped, steps.placeholders)
        eps = c.rms_norm_eps
        qkv, total = run("qkv", lambda: skinny_norm_linear(hidden, residual, self.norms[0], eps, self.w_qkv,
                                                                config=tilings.get("qkv")))
        q, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)
        q = run("rope+store", lambda: rope_and_store(
            q.view(batch, c.num_heads, c.head_dim), k.view(batch, c.num_kv_heads, c.head_dim),
            v.view(batch, c.num_kv_heads, c.head_dim), steps.positions, steps.cos, steps.sin, self.k_cache,
            self.v_cache, steps.slots, q_norm_weight=self.head_norms[0], k_norm_weight=self.head_norms[1], eps=eps))
        attended = run("attention", lambda: paged_decode(
            q.view(batch, c.num_heads, c.head_dim), self.k_cache, self.v_cache, steps.tables, steps.seq_lens,
            c.head_dim ** -0.5, steps.num_splits, steps.workspace, counters=steps.counters,
            block_n=steps.decode_block_n))
        o = run("o", lambda: skinny_linear(attended.reshape(batch, q_width), self.w_o, config=tilings.get("o")))
        gate_up, total = run("gate_up", lambda: skinny_norm_linear(o, total, self.norms[1], eps, self.w_gate_up,
                                                                    config=tilings.get("gate_up")))
        return run("down", lambda: skinny_silu_linear(gate_up, self.w_down, config=tilings.get("down"))), total


@dataclass
class StepInputs:
    """What every layer of one decode step shares: the sequences' positions, slots and block tables,
    the rotary tables, the split decode's scratch, and an output of each kind for kinds left out."""

    positions: torch.Tensor
    slots: torch.Tensor
    tables: torch.Tensor
    seq_lens: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    num_splits: int
    decode_block_n: int
    workspace: torch.Tensor | None
    counters: torch.Tensor | None
    placeholders: dict[str, object]


def blocks_per_sequence(context: int, block_size: int) -> int:
    """KV blocks a sequence of context tokens and its new one holds."""
    return -(-(context + 1) // block_size)


def step_inputs(config: ModelConfig, block_size: int, batch: int, context: int, max_model_len: int,
                dtype: torch.dtype, device: torch.device, num_splits: int | None = None,
                decode_block_n: int | None = None) -> StepInputs:
    """num_splits: as a graph captured for max_model_len has when None; decode_block_n: the kernel's default."""
    from worker_service.attention.triton_decode import DECODE_BLOCK_N, choose_num_splits, new_decode_scratch

    c = config
    blocks = blocks_per_sequence(context, block_size)
    tables = torch.arange(batch * blocks, dtype=torch.int32, device=device).view(batch, blocks)
    positions = torch.full((batch,), context, dtype=torch.int64, device=device)
    slots = tables[:, context // block_size].long() * block_size + context % block_size
    rotary = RotaryEmbedding(c.head_dim, max_model_len, c.rope_theta, c.rope_scaling).to(device)
    num_splits = num_splits or choose_num_splits(batch, c.num_kv_heads, max_model_len, device)
    workspace, counters = new_decode_scratch(batch, c.num_heads, c.num_kv_heads, c.head_dim, num_splits, device)
    qkv_width = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    new = lambda *shape: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
    heads = new(batch, c.num_heads, c.head_dim)
    return StepInputs(
        positions=positions, slots=slots, tables=tables,
        seq_lens=torch.full((batch,), context + 1, dtype=torch.int32, device=device),
        cos=rotary.cos, sin=rotary.sin, num_splits=num_splits, decode_block_n=decode_block_n or DECODE_BLOCK_N,
        workspace=workspace, counters=counters,
        placeholders={"qkv": (new(batch, qkv_width), new(batch, c.hidden_size)), "rope+store": heads,
                      "attention": heads, "o": new(batch, c.hidden_size),
                      "gate_up": (new(batch, 2 * c.intermediate_size), new(batch, c.hidden_size)),
                      "down": new(batch, c.hidden_size)})


def _runner(skipped: frozenset[str], placeholders: dict[str, object]) -> Callable[[str, Callable[[], object]], object]:
    def run(kind: str, kernel: Callable[[], object]) -> object:
        return placeholders[kind] if kind in skipped else kernel()

    return run


def chain(layers: list[Layer], steps: StepInputs, hidden: torch.Tensor, skipped: frozenset[str],
          tilings: dict[str, SkinnyConfig] | None = None) -> torch.Tensor:
    residual = torch.zeros_like(hidden)
    for layer in layers:
        hidden, residual = layer.forward(hidden, residual, steps, skipped, tilings or {})
    return hidden


def time_graph(fn: Callable[[], object], replays: int) -> float:
    """Seconds per call of fn captured in a CUDA graph (after an eager warm-up that compiles)."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / replays


def variants() -> list[tuple[str, frozenset[str]]]:
    """(name, kinds left out): the whole chain, each kind left out, each kind alone."""
    everything = frozenset(KINDS)
    return ([("all six", frozenset())] + [(f"without {kind}", frozenset({kind})) for kind in KINDS]
            + [(f"{kind} alone", everything - {kind}) for kind in KINDS])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=768, help="tokens already in each sequence's cache")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--max-model-len", type=int, default=4096, help="sizes the decode splits, as a graph's")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s the floor assumes (an H200's copy)")
    parser.add_argument("--without-pdl", action="store_true", help="launch the kernels without PDL")
    parser.add_argument("--sweep-products", action="store_true", help="each product alone under other tilings")
    parser.add_argument("--sweep-attention", action="store_true", help="other split counts and tile widths")
    parser.add_argument("--num-splits", type=int, help="decode splits (default: as a graph for --max-model-len)")
    parser.add_argument("--decode-block-n", type=int, help="context tokens per decode tile")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, one eager pass, no timing")
    args = parser.parse_args()
    if args.without_pdl:
        from worker_service.layers import triton_pdl

        triton_pdl.ENABLED = False
    if args.smoke:
        return smoke()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device (or --smoke)")
    device, dtype, config = torch.device("cuda"), torch.bfloat16, ModelConfig.from_hf_dict(QWEN3_0_6B)
    torch.manual_seed(0)
    layers = [Layer(config, BLOCK_SIZE, args.batch, args.context, dtype, device) for _ in range(args.layers)]
    steps = step_inputs(config, BLOCK_SIZE, args.batch, args.context, args.max_model_len, dtype, device,
                        args.num_splits, args.decode_block_n)
    hidden = torch.randn(args.batch, config.hidden_size, device=device).to(dtype)
    # One layer's products and its sequences' K/V, read once (memory_floor's counts).
    kv_bytes = args.batch * (args.context + 1) * kv_bytes_per_token(config, fp8=False) / config.num_layers
    floor = (2 * (attention_params(config) + dense_mlp_params(config)) + kv_bytes) / args.bandwidth
    print(f"{torch.cuda.get_device_name()}: batch {args.batch}, context {args.context}, {args.layers} layers, "
          f"{steps.num_splits} decode splits, PDL {'off' if args.without_pdl else 'on'}; floor a layer "
          f"{floor * 1e6:.2f} us (weights and K/V at {args.bandwidth / 1e12:.1f} TB/s)")
    whole = None
    for name, skipped in variants():
        seconds = time_graph(lambda skipped=skipped: chain(layers, steps, hidden, skipped), args.replays)
        per_layer = seconds / args.layers * 1e6
        whole = per_layer if whole is None else whole
        saved = f"   leaving it out saves {whole - per_layer:6.2f} us" if name.startswith("without") else ""
        print(f"{name:<22} {per_layer:7.2f} us a layer{saved}", flush=True)
    if args.sweep_products:
        sweep_products(layers, steps, hidden, args.replays)
    if args.sweep_attention:
        sweep_attention(args, config, layers, hidden, dtype, device)
    return 0


def sweep_attention(args: argparse.Namespace, config: ModelConfig, layers: list[Layer], hidden: torch.Tensor,
                    dtype: torch.dtype, device: torch.device) -> None:
    """The attention alone and the whole chain at each split count and tile width."""
    for num_splits in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64):
        for block_n in (32, 64, 128):
            swept = step_inputs(config, BLOCK_SIZE, args.batch, args.context, args.max_model_len, dtype, device,
                                num_splits, block_n)
            alone, whole = (time_graph(lambda skipped=skipped: chain(layers, swept, hidden, skipped),  # noqa: B023
                                       args.replays) / args.layers * 1e6
                            for skipped in (frozenset(KINDS) - {"attention"}, frozenset()))
            print(f"attention {num_splits:2d} splits, tiles of {block_n:3d}: alone {alone:6.2f} us a layer, "
                  f"all six {whole:6.2f}", flush=True)


def product_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(N, K) of each product kind's weight."""
    c = config
    return {"qkv": ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size),
            "o": (c.hidden_size, c.num_heads * c.head_dim), "gate_up": (2 * c.intermediate_size, c.hidden_size),
            "down": (c.hidden_size, c.intermediate_size)}


def tilings_to_try(batch: int, n: int, k: int) -> list[SkinnyConfig]:
    """_config's tiling first, then the CUDA-core one-pass tilings of other widths and warp counts."""
    chosen = _config(batch, n, k)
    if chosen.use_dot:
        return [chosen]
    others = [SkinnyConfig(block_n, chosen.block_k, warps, 1, False) for block_n in (1, 2, 4, 8, 16)
              for warps in (2, 4, 8) if block_n * chosen.block_k <= 32768]
    return [chosen] + [tiling for tiling in others if tiling != chosen]


def sweep_products(layers: list[Layer], steps: StepInputs, hidden: torch.Tensor, replays: int) -> None:
    everything = frozenset(KINDS)
    for kind, (n, k) in product_shapes(layers[0].config).items():
        for tiling in tilings_to_try(hidden.shape[0], n, k):
            seconds = time_graph(lambda kind=kind, tiling=tiling: chain(layers, steps, hidden, everything - {kind},
                                                                        {kind: tiling}), replays)
            print(f"{kind:<8} alone N {n:5d} K {k:5d} block_n {tiling.block_n:2d} block_k {tiling.block_k:4d} "
                  f"warps {tiling.num_warps}: {seconds / len(layers) * 1e6:6.2f} us a layer "
                  f"({triton.cdiv(n, tiling.block_n)} programs)", flush=True)


def smoke() -> int:
    """One eager pass of a tiny layer: whole, with a kind left out and with one kept (every kind's kernel
    and every placeholder; on a CPU the kernels run through Triton's interpreter)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16  # the interpreter's bf16 tl.dot is wrong (tests/worker_service/test_triton_attention.py)
    torch.manual_seed(0)
    config = ModelConfig.from_hf_dict(TINY)
    layers = [Layer(config, TINY_BLOCK_SIZE, 2, 40, dtype, device)]
    steps = step_inputs(config, TINY_BLOCK_SIZE, 2, 40, 256, dtype, device)
    hidden = torch.randn(2, config.hidden_size, device=device).to(dtype)
    for name, skipped in variants()[:2] + variants()[-6:-5]:
        out = chain(layers, steps, hidden, skipped)
        assert out.shape == hidden.shape and bool(torch.isfinite(out).all()), name
        print(f"{name}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
