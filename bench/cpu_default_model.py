"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) on the CPU: single-stream decode speed and
16-stream throughput, ours (offline LLM) against transformers' generate on the same file in the
same process. Greedy, EOS ignored, float32.

    python bench/cpu_default_model.py [--new-tokens 128] [--streams 16]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

QUESTIONS = [
    "Write a short story about a lighthouse keeper.", "Explain how a bicycle works.",
    "What is the capital of France?", "Describe the water cycle.", "Give three tips for learning to cook.",
    "Why is the sky blue?", "Write a haiku about the sea.", "What do bees do in winter?",
]


def main() -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from common import SamplingParams
    from common.default_model import default_model_path
    from scheduler_service import LLM

    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=16)
    args = parser.parse_args()
    path = Path(default_model_path())
    llm = LLM(str(path), block_size=16, cpu_kv_cache_bytes=1 << 29, device="cpu")
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                                 tokenize=True) for i in range(args.streams)]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None

    def ours(batch: list[list[int]]) -> float:
        started = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        return sum(len(o["token_ids"]) for o in outputs) / (time.perf_counter() - started)

    def transformers(batch: list[list[int]]) -> float:
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        started = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False,
                              pad_token_id=0)
        return (out.shape[1] - width) * len(batch) / (time.perf_counter() - started)

    ours([prompts[0]])  # warm-up
    transformers([prompts[0]])
    rows = [("single stream", ours([prompts[0]]), transformers([prompts[0]])),
            (f"{args.streams} streams", ours(prompts), transformers(prompts))]
    print(f"torch threads: {torch.get_num_threads()}; {args.new_tokens} new tokens per stream")
    print(f"{'':16} {'ours tok/s':>11} {'transformers':>13} {'ours/transformers':>18}")
    for name, mine, theirs in rows:
        print(f"{name:16} {mine:>11.1f} {theirs:>13.1f} {mine / theirs:>18.2f}")
    print(f"ours, {args.streams} streams / single stream: {rows[1][1] / rows[0][1]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
