"""What the FP8 KV cache costs in quality: teacher-forced next-token predictions over real text with
`kv_cache_dtype="fp8"` against the same model with the unquantized cache (`auto`).

The text is Python's own documentation (the stdlib's pydoc_data.topics, English prose with some
code, present in every Python install), tokenized with the model's tokenizer and cut into windows.
Each window is fed as one sequence: prefill chunks of --chunk-len tokens (every position's logits
kept), whose attention reads K/V back from the paged cache, so every prediction after a window's
first chunk depends on quantized K/V of earlier chunks and, within a chunk, of its own tokens.
With --num-decode-positions the last positions of each window run as one-token decode steps
instead (the decode kernel on a GPU). Reported: top-1 agreement of the two runs, perplexity of the
text under each, and the largest |K| and |V| per layer (how far inside e4m3's range of 448 they lie).
With --reference-dtype (e.g. float32) a third run in that dtype with the unquantized cache is the
reference, and each run's top-1 agreement with it is reported too (issue 31's 95 % was measured so).

    python bench/fp8_kv_quality.py                      # the default model on the CPU
    python bench/fp8_kv_quality.py --device cuda --dtype bfloat16 --reference-dtype float32 --model PATH
"""
from __future__ import annotations

import argparse
import hashlib
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.contract.config import WorkerConfig  # noqa: E402
from common.generated.nanovllm.worker.v1 import worker_pb2  # noqa: E402
from worker_service.attention.kv_quant import FP8_MAX  # noqa: E402
from worker_service.layers import fused_kernels  # noqa: E402
from worker_service.runtime.batch import ScheduledChunk, build_model_input  # noqa: E402
from worker_service.runtime.model_runner import ModelRunner  # noqa: E402
from worker_service.runtime.sequence_state import WorkerSequence  # noqa: E402

BLOCK_SIZE = 16


@dataclass
class QualityReport:
    num_positions: int
    top1_agreement: float
    perplexity_auto: float
    perplexity_fp8: float
    max_abs_k: list[float]  # per layer, from the unquantized cache
    max_abs_v: list[float]
    # The unquantized run's logit margin (top-1 minus top-2) where the two runs disagree: near-ties
    # that any perturbation can flip, or real changes.
    disagreement_margins: list[float]
    # Top-1 agreement of the auto and fp8 runs with the --reference-dtype run, where there is one.
    reference_agreement: dict[str, float] | None = None
    reference_dtype: str | None = None

    def lines(self) -> list[str]:
        change = self.perplexity_fp8 / self.perplexity_auto - 1
        reference = [] if self.reference_agreement is None else [
            f"top-1 agreement with the {self.reference_dtype} reference: "
            + ", ".join(f"{name} {share:.4f}" for name, share in self.reference_agreement.items())]
        return [f"positions {self.num_positions}",
                f"top-1 agreement fp8 vs auto: {self.top1_agreement:.4f}",
                f"perplexity auto {self.perplexity_auto:.4f}, fp8 {self.perplexity_fp8:.4f} ({change:+.3%})",
                f"max |K| per layer: {' '.join(f'{x:.3g}' for x in self.max_abs_k)} (e4m3 max {FP8_MAX:g})",
                f"max |V| per layer: {' '.join(f'{x:.3g}' for x in self.max_abs_v)}",
                f"disagreements: {len(self.disagreement_margins)}, unquantized top-1 minus top-2 logit margin there: "
                f"median {statistics.median(self.disagreement_margins or [0.0]):.3f}, "
                f"{sum(m < 0.1 for m in self.disagreement_margins)} below 0.1, "
                f"{sum(m < 0.5 for m in self.disagreement_margins)} below 0.5", *reference]


def real_text() -> str:
    """About 460,000 characters of English documentation from the standard library."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[name] for name in sorted(topics))


def make_runner(model: str, device: str, dtype: str, kv_cache_dtype: str, num_blocks: int,
                max_num_batched_tokens: int) -> ModelRunner:
    config = WorkerConfig(model=model, device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                          block_size=BLOCK_SIZE, num_kv_blocks=num_blocks, max_num_seqs=4,
                          max_num_batched_tokens=max_num_batched_tokens, max_model_len=num_blocks * BLOCK_SIZE)
    if device == "cuda":
        fused_kernels.enable()  # as a worker does at start
    runner = ModelRunner(config)
    runner.init_cache(num_blocks)
    return runner


@torch.inference_mode()
def window_logits(runner: ModelRunner, tokens: list[int], chunk_len: int, num_decode_positions: int) -> torch.Tensor:
    """float32 logits [len(tokens), vocab] of one sequence fed in prefill chunks, then, for its last
    num_decode_positions tokens, one decode step each (through a CUDA graph where one is captured)."""
    block_table = list(range(-(-len(tokens) // BLOCK_SIZE)))

    def chunk_at(start: int, chunk: list[int], samples: bool) -> ScheduledChunk:
        state = WorkerSequence(seq_id=1, block_table=block_table, num_computed_tokens=start, num_tokens=len(tokens),
                               num_prompt_tokens=len(tokens), sampling=worker_pb2.SamplingParams())
        return ScheduledChunk(state, chunk, samples=samples)

    prefill_end = len(tokens) - num_decode_positions
    logits = []
    for start in range(0, prefill_end, chunk_len):
        chunk = tokens[start:min(start + chunk_len, prefill_end)]
        model_input = build_model_input([chunk_at(start, chunk, False)], BLOCK_SIZE, runner.device)
        hidden = runner.model(model_input.input_ids, model_input.positions, model_input.metadata)
        logits.append(runner.model.compute_logits(hidden).float().cpu())
    for position in range(prefill_end, len(tokens)):
        model_input = build_model_input([chunk_at(position, [tokens[position]], True)], BLOCK_SIZE, runner.device)
        logits.append(runner.forward_logits(model_input).float().cpu())
    return torch.cat(logits)


def layer_amax(runner: ModelRunner, num_blocks: int) -> tuple[list[float], list[float]]:
    cache = runner.kv_cache[:, :, :num_blocks].float().abs()
    return cache[:, 0].amax(dim=(1, 2, 3, 4)).tolist(), cache[:, 1].amax(dim=(1, 2, 3, 4)).tolist()


def compare(model: str, windows: list[list[int]], device: str = "cpu", dtype: str = "auto", chunk_len: int = 256,
            num_decode_positions: int = 0, reference_dtype: str | None = None) -> QualityReport:
    """Teacher-forced fp8 vs auto over windows of tokens (each predicts its tokens 1..end); with
    reference_dtype, both also against a run in that dtype with the unquantized cache."""
    num_blocks = -(-max(len(w) for w in windows) // BLOCK_SIZE)
    runs = {"auto": (dtype, "auto"), "fp8": (dtype, "fp8")}
    if reference_dtype is not None:
        runs["reference"] = (reference_dtype, "auto")
    runners = {name: make_runner(model, device, run_dtype, kv_cache_dtype, num_blocks, max(chunk_len, 64))
               for name, (run_dtype, kv_cache_dtype) in runs.items()}
    nll = {"auto": 0.0, "fp8": 0.0}
    agree = positions = 0
    # Positions where each run's top-1 is the reference run's, where there is one.
    reference_agree = dict.fromkeys(nll, 0) if reference_dtype is not None else {}
    margins: list[float] = []
    amax_k = amax_v = None
    for tokens in windows:
        target = torch.tensor(tokens[1:])
        logits = {name: window_logits(runner, tokens, chunk_len, num_decode_positions)[:-1]
                  for name, runner in runners.items()}
        for name in nll:
            nll[name] += torch.nn.functional.cross_entropy(logits[name], target, reduction="sum").item()
        top1 = {name: window.argmax(-1) for name, window in logits.items()}
        k, v = layer_amax(runners["auto"], -(-len(tokens) // BLOCK_SIZE))
        amax_k = k if amax_k is None else [max(a, b) for a, b in zip(amax_k, k, strict=True)]
        amax_v = v if amax_v is None else [max(a, b) for a, b in zip(amax_v, v, strict=True)]
        same = top1["auto"] == top1["fp8"]
        agree += same.sum().item()
        for name in reference_agree:
            reference_agree[name] += (top1[name] == top1["reference"]).sum().item()
        top2 = logits["auto"][~same].topk(2, dim=-1).values
        margins += (top2[:, 0] - top2[:, 1]).tolist()
        positions += len(tokens) - 1
    reference = {name: count / positions for name, count in reference_agree.items()} or None
    return QualityReport(positions, agree / positions, math.exp(nll["auto"] / positions),
                         math.exp(nll["fp8"] / positions), amax_k, amax_v, margins, reference, reference_dtype)


def text_windows(model: str, num_windows: int, window_len: int) -> list[list[int]]:
    from scheduler_service.api.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model)
    if tokenizer is None:
        raise SystemExit(f"{model}: no tokenizer")
    tokens = tokenizer.encode(real_text(), add_special_tokens=False)
    if len(tokens) < num_windows * window_len:
        raise SystemExit(f"the text has {len(tokens)} tokens, fewer than {num_windows} x {window_len}")
    return [tokens[i * window_len:(i + 1) * window_len] for i in range(num_windows)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder or .gguf (default: the default model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-windows", type=int, default=3)
    parser.add_argument("--window-len", type=int, default=1024)
    parser.add_argument("--chunk-len", type=int, default=256)
    parser.add_argument("--num-decode-positions", type=int, default=0, help="per window, run as decode steps")
    parser.add_argument("--reference-dtype", help="also a run in this dtype (e.g. float32), unquantized cache, "
                        "that both runs' top-1 is compared with")
    args = parser.parse_args(argv)
    if args.model is None:
        from common.formats.default_model import default_model_path

        args.model = default_model_path()
    text = real_text()
    print(f"model {args.model}\ntext pydoc_data.topics of Python {sys.version.split()[0]}, {len(text)} chars, "
          f"sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}")
    windows = text_windows(args.model, args.num_windows, args.window_len)
    print(f"{args.num_windows} windows of {args.window_len} tokens, prefill chunks of {args.chunk_len}, "
          f"{args.num_decode_positions} decode positions per window, device {args.device}, dtype {args.dtype}, "
          f"reference {args.reference_dtype or 'none'}")
    report = compare(args.model, windows, args.device, args.dtype, args.chunk_len, args.num_decode_positions,
                     args.reference_dtype)
    print("\n".join(report.lines()))


if __name__ == "__main__":
    main()
