"""Does a greedy answer depend on what else is in the batch? Prompts of real text (windows of
tests/data/python_license.txt, of different lengths) generated all together, in halves, and one at a
time, through the offline LLM; prints how many prompts got the same tokens each way and where the
first differences are. Run it with and without --deterministic (and --kv-cache-dtype fp8) to see
what the mode changes; on any device:

    python bench/batch_invariance.py                       # the default model, on the CPU or a GPU
    python bench/batch_invariance.py --deterministic --num-prompts 64 --model PATH.gguf --json-out F
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from common.contract.sampling_params import SamplingParams
from offline.llm import LLM

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "python_license.txt"


def prompts_of(llm: LLM, count: int, min_tokens: int, max_tokens: int) -> list[list[int]]:
    """count windows of the text, lengths spread evenly over [min_tokens, max_tokens], starts spread too."""
    tokens = llm.encode(TEXT.read_text())
    span = max(1, count - 1)
    lengths = [min_tokens + (max_tokens - min_tokens) * i // span for i in range(count)]
    starts = [(len(tokens) - length) * ((i * 7) % count) // max(1, count) for i, length in enumerate(lengths)]
    return [tokens[start:start + length] for start, length in zip(starts, lengths, strict=True)]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None if len(a) == len(b) else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder or .gguf (default: the default model)")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--min-prompt-tokens", type=int, default=16)
    parser.add_argument("--max-prompt-tokens", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--cpu-weight-format", default="auto", choices=["auto", "float32", "int4"])
    parser.add_argument("--json-out")
    args = parser.parse_args()
    llm = LLM(args.model, deterministic=args.deterministic, kv_cache_dtype=args.kv_cache_dtype, device=args.device,
              dtype=args.dtype, cpu_weight_format=args.cpu_weight_format, max_model_len=2048)
    prompts = prompts_of(llm, args.num_prompts, args.min_prompt_tokens, args.max_prompt_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    started = time.perf_counter()
    together = [out["token_ids"] for out in llm.generate(prompts, params, use_tqdm=False)]
    half = len(prompts) // 2 or 1
    halves = [out["token_ids"] for part in (prompts[:half], prompts[half:]) if part
              for out in llm.generate(part, params, use_tqdm=False)]
    alone = [llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"] for prompt in prompts]
    seconds = time.perf_counter() - started
    llm.close()
    differences = [first_difference(a, b) for a, b in zip(together, alone, strict=True)]
    result = {
        "options": vars(args), "num_prompts": len(prompts), "seconds": round(seconds, 1),
        "together_equals_alone": sum(d is None for d in differences),
        "together_equals_halves": sum(a == b for a, b in zip(together, halves, strict=True)),
        "first_differences": sorted(d for d in differences if d is not None),
    }
    print(json.dumps(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
