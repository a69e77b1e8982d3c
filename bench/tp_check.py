"""Tensor-parallel correctness on a GPU machine with two GPUs, on a random checkpoint of Qwen3-0.6B's
shapes: float32 greedy at tensor parallel 2 against 1 (CUDA graphs and eager), and bfloat16
teacher-forced logits at tensor parallel 2 against transformers in float32 (top-1 agreement), beside
tensor parallel 1 and transformers in bfloat16 against the same reference.

    python bench/tp_check.py --json-out out/tp_check.json
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

NUM_NEW_TOKENS = 64


def prompts(vocab_size: int, count: int = 8) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(5, 150))] for _ in range(count)]


def generate(model: str, batch: list[list[int]], tensor_parallel_size: int, enforce_eager: bool,
             temperature: float = 0.0) -> tuple[list[list[int]], str]:
    """The tokens (float32), and how rank 0 summed the layers' partial results."""
    from common import SamplingParams
    from offline import LLM

    params = SamplingParams(temperature=temperature, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    with LLM(model, device="cuda", dtype="float32", block_size=16, num_kv_blocks=512, max_num_seqs=16,
             max_num_batched_tokens=512, enforce_eager=enforce_eager, tensor_parallel_size=tensor_parallel_size) as llm:
        tokens = [r["token_ids"] for r in llm.generate(batch, params, use_tqdm=False)]
        return tokens, sums_path() if tensor_parallel_size > 1 else "none"


def sums_path() -> str:
    """How this rank's group sums the layers' partial results."""
    from worker_service.parallel.distributed import sums_in_symmetric_memory

    return "symmetric memory" if sums_in_symmetric_memory() else "NCCL"


def _teacher_forced_rank(rank: int, model: str, sequences: list[tuple[list[int], int]], address: str,
                         out_path: str) -> None:
    """One rank of the group: our bf16 logits of every sequence (prefill chunks, then graph-replayed
    decode steps, as tests/worker_service/test_gpu_model.py does on one GPU)."""
    sys.path.insert(0, str(REPO_ROOT))
    from tests.worker_service.test_gpu_model import teacher_forced_logits
    from worker_service.parallel.distributed import destroy_tensor_parallel, init_tensor_parallel

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    init_tensor_parallel(rank, 2, address, device)
    logits = [teacher_forced_logits(Path(model), tokens, prompt_len) for tokens, prompt_len in sequences]
    if rank == 0:
        torch.save({"logits": torch.cat(logits), "sums": sums_path()}, out_path)
    destroy_tensor_parallel()


def teacher_forced(model: str, batch: list[list[int]], continuations: list[list[int]]) -> dict:
    import torch.multiprocessing as mp

    from common.net.ports import free_port

    sequences = [(p + c, len(p)) for p, c in zip(batch, continuations, strict=True)]
    reference = {dtype: _transformers_logits(model, sequences, dtype) for dtype in (torch.float32, torch.bfloat16)}
    out_path = str(Path(tempfile.mkdtemp()) / "logits.pt")
    mp.start_processes(_teacher_forced_rank, args=(model, sequences, f"tcp://127.0.0.1:{free_port()}", out_path),
                       nprocs=2, start_method="spawn")
    from tests.worker_service.test_gpu_model import teacher_forced_logits

    tp2 = torch.load(out_path)
    ours = {"tp2": tp2["logits"],
            "tp1": torch.cat([teacher_forced_logits(Path(model), tokens, n) for tokens, n in sequences])}
    exact = reference[torch.float32]
    result = {"positions": exact.shape[0], "tp2_sums": tp2["sums"],
              "top1_agreement": _agreement(ours["tp2"], exact),  # the measure
              "relative_error": ((ours["tp2"] - exact).norm() / exact.norm()).item(),
              # Beside it, what bfloat16 alone costs on this random checkpoint:
              "tp1_top1_agreement": _agreement(ours["tp1"], exact),
              "transformers_bf16_top1_agreement": _agreement(reference[torch.bfloat16], exact),
              "tp2_vs_transformers_bf16_top1": _agreement(ours["tp2"], reference[torch.bfloat16]),
              "tp2_vs_tp1_top1": _agreement(ours["tp2"], ours["tp1"])}
    return result


def _transformers_logits(model: str, sequences: list[tuple[list[int], int]], dtype: torch.dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).cuda().eval()
    with torch.no_grad():
        logits = torch.cat([hf(torch.tensor([tokens], device="cuda")).logits[0, n - 1:-1].float().cpu()
                            for tokens, n in sequences])
    del hf
    torch.cuda.empty_cache()
    return logits


def _agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.argmax(-1) == b.argmax(-1)).float().mean().item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random-qwen3-0.6b")
    parser.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "nanovllm-bench"))
    parser.add_argument("--json-out")
    args = parser.parse_args()
    from bench.random_checkpoint import RANDOM_MODELS, random_model_folder

    model = args.model
    if model in RANDOM_MODELS:
        model = str(random_model_folder(Path(args.work_dir), model))
    vocab_size = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    batch = prompts(vocab_size)
    results: dict = {}
    # The first group of this process sums in symmetric memory, later ones through NCCL
    # (distributed.init_symmetric_sum): the graphs run checks the one, the others the other.
    # Temperature 0.8 samples through the fused kernel (over each rank's slice of the vocabulary at TP=2).
    for name, eager, temperature in (("greedy_graphs", False, 0.0), ("greedy_eager", True, 0.0),
                                     ("temperature_graphs", False, 0.8)):
        one, _ = generate(model, batch, 1, eager, temperature)
        print(f"float32 {name}, tensor parallel 1: done", file=sys.stderr, flush=True)
        two, sums = generate(model, batch, 2, eager, temperature)
        print(f"float32 {name}, tensor parallel 2: done", file=sys.stderr, flush=True)
        same = sum(a == b for a, b in zip(one, two, strict=True))
        tokens = sum(x == y for a, b in zip(one, two, strict=True) for x, y in zip(a, b, strict=True))
        results[f"float32_{name}"] = {"sequences_exact": same, "sequences": len(batch), "sums": sums,
                                      "tokens_equal": tokens, "tokens": len(batch) * NUM_NEW_TOKENS}
        if name == "greedy_graphs":
            continuations = one
    results["bfloat16_teacher_forced"] = teacher_forced(model, batch, continuations)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    for name, value in results.items():
        print(f"RESULT {name}: {json.dumps(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
