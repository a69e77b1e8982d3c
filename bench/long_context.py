"""One stream at long context, in-process, per attention backend, on the random Qwen3-0.6B (bf16): the
first token of long prompts and the time per token of decoding over a long context, against floors.

    python bench/long_context.py [--backends triton,flash-attn] [--prompt-lens 32768,40000]
                                 [--decode-context 32768] [--output-len 128]

Prefill floor: the FLOPs a prompt needs (every layer's products, causal attention over
n (n + 1) / 2 query-key pairs, the output head for the one sampled token) at 790 TFLOP/s, the bf16
dense product rate of an H200 (8192^3 measured at 813). Decode floor: a step's bytes (the weights and
the sequence's K/V, bench/memory_floor) at 4.3 TB/s, an H200's device copy. TTFT is the median of
--repeats fresh prompts (no prefix-cache hits), after a warm-up prompt of the longest length.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.memory_floor import attention_params, dense_mlp_params, kv_bytes_per_token, weight_bytes  # noqa: E402
from bench.single_stream import run  # noqa: E402
from worker_service.models.config import ModelConfig  # noqa: E402

FLOP_RATE = 790e12
BANDWIDTH = 4.3e12


def prefill_flops(config: ModelConfig, prompt_len: int) -> float:
    """A dense model's prefill: its products, causal attention, the output head for one token."""
    products = 2 * config.num_layers * (attention_params(config) + dense_mlp_params(config)) * prompt_len
    pairs = prompt_len * (prompt_len + 1) / 2
    attention = 4 * config.num_layers * config.num_heads * config.head_dim * pairs
    return products + attention + 2 * config.hidden_size * config.vocab_size


def decode_step_floor_seconds(config: ModelConfig, context: int) -> float:
    """One sequence's decode step at context: the weights and its K/V read once."""
    dense, _ = weight_bytes(config)
    return (dense + context * kv_bytes_per_token(config, fp8=False)) / BANDWIDTH


def measure(model: Path, backend: str, args: argparse.Namespace, config: ModelConfig) -> None:
    from offline import LLM

    prompt_lens = [int(n) for n in args.prompt_lens.split(",")]
    max_model_len = max(prompt_lens + [args.decode_context]) + args.output_len + 1
    with LLM(str(model), max_model_len=max_model_len, attention_backend=backend, dtype="bfloat16") as llm:
        rng = random.Random(0)
        vocab = llm.worker.describe().vocab_size

        def prompt(length: int) -> list[int]:
            return [rng.randrange(vocab) for _ in range(length)]

        run(llm, prompt(max(prompt_lens)), 2)  # warm-up: compiles what the first long prompt would
        for prompt_len in prompt_lens:
            ttft = statistics.median(run(llm, prompt(prompt_len), 1) for _ in range(args.repeats))
            floor = prefill_flops(config, prompt_len) / FLOP_RATE
            print(f"{backend:>10}  prompt {prompt_len:>6}: TTFT {ttft * 1e3:7.1f} ms, FLOP floor {floor * 1e3:6.1f} ms "
                  f"({floor / ttft:.2f} of it)", flush=True)
        ttft = run(llm, prompt(args.decode_context), 1)
        total = run(llm, prompt(args.decode_context), args.output_len + 1)
        itl = (total - ttft) / args.output_len
        floor = decode_step_floor_seconds(config, args.decode_context + args.output_len // 2)
        print(f"{backend:>10}  decode at {args.decode_context} of context: {itl * 1e3:.3f} ms a token over "
              f"{args.output_len}, memory floor {floor * 1e3:.3f} ms ({itl / floor:.2f}x it)", flush=True)


def main() -> int:
    from bench.random_checkpoint import make_random_checkpoint

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="triton,flash-attn")
    parser.add_argument("--prompt-lens", default="32768,40000")
    parser.add_argument("--decode-context", type=int, default=32768)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work-dir", default="/tmp/nanovllm-bench")
    parser.add_argument("--model", help="a checkpoint folder (default: the random Qwen3-0.6B, made once)")
    args = parser.parse_args()
    model = Path(args.model) if args.model else make_random_checkpoint(Path(args.work_dir) / "random-qwen3-0.6b")
    config = ModelConfig.from_hf_folder(model)
    for backend in args.backends.split(","):
        measure(model, backend, args, config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
