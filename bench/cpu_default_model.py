"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) on the CPU, three engines on the same file in one
process: ours (offline LLM; int4 and float32 weights), transformers' generate (float32) and llama.cpp
(llama-cpp-python, when installed: `pip install .[llamacpp]`). Greedy, EOS ignored, one thread count for all.

    python bench/cpu_default_model.py [--new-tokens 128] [--streams 16] [--prefill 512,2000] [--threads 2]

Measures single-stream decode tok/s (after the prompt), 16-stream decode tok/s (ours and transformers;
llama-cpp-python has no batched API) and prefill tok/s (a prompt of N tokens of real text, one token out),
and prints each figure with its ratio to ours (int4), the default on CPU. The engines take turns run by
run (best of --repeats rounds), so that load from elsewhere on a shared machine falls on all of them.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

QUESTIONS = [
    "Write a short story about a lighthouse keeper.", "Explain how a bicycle works.",
    "What is the capital of France?", "Describe the water cycle.", "Give three tips for learning to cook.",
    "Why is the sky blue?", "Write a haiku about the sea.", "What do bees do in winter?",
]
TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "python_license.txt"

Engine = dict[str, Callable[..., float]]


def best_interleaved(repeats: int, runs: dict[str, Callable[[], float]]) -> dict[str, float]:
    """The best rate of each engine over several rounds, the engines taking turns within a round: the
    machine is shared, others' load only ever slows a run down, and a burst of it then falls on
    every engine alike rather than on whichever ran at that moment."""
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            rate = run()  # nan: an engine that cannot run this measure
            if not math.isnan(rate):
                rates[name].append(rate)
    return {name: max(measured, default=math.nan) for name, measured in rates.items()}


def cell(value: float, decimals: int) -> str:
    return f"{'-' if math.isnan(value) else f'{value:.{decimals}f}':>14}"


def ours_engine(path: Path, weight_format: str, new_tokens: int, **options: object) -> Engine:
    """Our offline LLM's measures; options: more of its options."""
    from common import SamplingParams
    from offline import LLM

    llm = LLM(str(path), block_size=16, cpu_kv_cache_bytes=1 << 29, device="cpu", cpu_weight_format=weight_format,
              **options)

    def decode(batch: list[list[int]]) -> float:
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        # the rate after the first token: prefill is measured on its own
        first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        started = time.perf_counter()
        llm.generate(batch, first, use_tqdm=False)
        prefill_s = time.perf_counter() - started
        started = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        elapsed = time.perf_counter() - started - prefill_s
        return sum(len(o["token_ids"]) - 1 for o in outputs) / elapsed

    def prefill(prompt: list[int]) -> float:
        started = time.perf_counter()
        # prefix caching would skip a repeated prompt: vary its first token
        llm.generate([[int(time.perf_counter_ns() % 1000) + 1000, *prompt[1:]]],
                     SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        return len(prompt) / (time.perf_counter() - started)

    return {"decode": decode, "prefill": prefill}


def transformers_engine(path: Path, new_tokens: int) -> Engine:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None

    def generate(batch: list[list[int]], num_tokens: int) -> float:
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        started = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, attention_mask=mask, max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                        do_sample=False, pad_token_id=0)
        return time.perf_counter() - started

    def decode(batch: list[list[int]]) -> float:
        return (new_tokens - 1) * len(batch) / (generate(batch, new_tokens) - generate(batch, 1))

    def prefill(prompt: list[int]) -> float:
        return len(prompt) / generate([prompt], 1)

    return {"decode": decode, "prefill": prefill}


def llama_cpp_engine(path: Path, new_tokens: int, threads: int, max_prompt: int) -> Engine | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama-cpp-python is not installed (pip install .[llamacpp]): no llama.cpp column")
        return None
    llm = Llama(model_path=str(path), n_ctx=max_prompt + new_tokens + 64, n_threads=threads,
                n_threads_batch=threads, n_batch=512, verbose=False)

    def run(prompt: list[int], num_tokens: int) -> float:
        llm.reset()
        started = time.perf_counter()
        llm.eval(prompt)
        for _ in range(num_tokens - 1):
            token = llm.sample(temp=0.0)
            llm.eval([token])
        return time.perf_counter() - started

    def decode(batch: list[list[int]]) -> float:
        if len(batch) > 1:
            return float("nan")
        return (new_tokens - 1) / (run(batch[0], new_tokens) - run(batch[0], 1))

    def prefill(prompt: list[int]) -> float:
        return len(prompt) / run(prompt, 1)

    return {"decode": decode, "prefill": prefill}


def default_model_inputs(streams: int) -> tuple[Path, list[list[int]], list[int]]:
    """The default model's path, `streams` chat prompts (QUESTIONS in turn) and the token ids of real text."""
    from common.formats.default_model import default_model_path
    from scheduler_service.api.tokenizer import load_tokenizer

    path = Path(default_model_path())
    tokenizer = load_tokenizer(str(path))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                             tokenize=True) for i in range(streams)]
    return path, prompts, tokenizer.encode(TEXT.read_text() * 2)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prefill", default="512,2000", help="prompt lengths (tokens of real text)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="runs per figure; the best is kept")
    parser.add_argument("--engines", default="int4,float32,transformers,llama.cpp")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)

    path, prompts, text_ids = default_model_inputs(args.streams)
    lengths = [int(n) for n in args.prefill.split(",")]
    names = args.engines.split(",")
    engines: dict[str, Engine] = {}
    for name in names:
        if name in ("int4", "float32"):
            engine = ours_engine(path, name, args.new_tokens)
        elif name == "transformers":
            engine = transformers_engine(path, args.new_tokens)
        else:
            engine = llama_cpp_engine(path, args.new_tokens, args.threads, max(lengths))
        if engine is not None:
            engine["decode"]([prompts[0]])  # warm-up
            engines[name] = engine
    measures = {"decode x1": ("decode", [prompts[0]]), f"decode x{args.streams}": ("decode", prompts),
                **{f"prefill {n}": ("prefill", text_ids[:n]) for n in lengths}}
    rows: dict[str, dict[str, float]] = {name: {} for name in engines}
    for label, (kind, work) in measures.items():
        runs = {name: lambda e=engine, k=kind, w=work: e[k](w) for name, engine in engines.items()}
        best = best_interleaved(args.repeats, runs)
        for name, rate in best.items():
            rows[name][label] = rate
        print(label, {name: round(rate, 1) for name, rate in best.items()}, flush=True)
    print(f"\ntok/s, {args.threads} threads, {args.new_tokens} new tokens per stream, best of {args.repeats}; "
          f"load average {os.getloadavg()[0]:.2f}")
    columns = list(next(iter(rows.values())))
    print(f"{'':14}" + "".join(f"{c:>14}" for c in columns))
    for name, figures in rows.items():
        print(f"{name:14}" + "".join(cell(figures[c], 1) for c in columns))
    if "int4" in rows:
        print("ratio int4 / engine:")
        for name, figures in rows.items():
            if name != "int4":
                print(f"{name:14}" + "".join(cell(rows["int4"][c] / figures[c], 2) for c in columns))
        int4 = rows["int4"]
        print(f"int4 {args.streams} streams / single stream: {int4[f'decode x{args.streams}'] / int4['decode x1']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
