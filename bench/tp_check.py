"""Tensor-parallel correctness on a GPU machine with two GPUs, on a random checkpoint of Qwen3-0.6B's
shapes: float32 greedy at tensor parallel 2 against 1 (CUDA graphs and eager), and bfloat16
teacher-forced logits at tensor parallel 2 against transformers in float32 (top-1 agreement).

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


def greedy(model: str, batch: list[list[int]], tensor_parallel_size: int, enforce_eager: bool) -> list[list[int]]:
    from common import SamplingParams
    from offline import LLM

    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    with LLM(model, device="cuda", dtype="float32", block_size=16, num_kv_blocks=512, max_num_seqs=16,
             max_num_batched_tokens=512, enforce_eager=enforce_eager, tensor_parallel_size=tensor_parallel_size) as llm:
        return [r["token_ids"] for r in llm.generate(batch, params, use_tqdm=False)]


def _teacher_forced_rank(rank: int, model: str, sequences: list[tuple[list[int], int]], address: str,
                         out_path: str) -> None:
    """One rank of the group: our bf16 logits of every sequence (prefill chunks, then graph-replayed
    decode steps, as tests/worker_service/test_gpu_model.py does on one GPU)."""
    sys.path.insert(0, str(REPO_ROOT))
    from tests.worker_service.test_gpu_model import teacher_forced_logits
    from worker_service.distributed import destroy_tensor_parallel, init_tensor_parallel

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    init_tensor_parallel(rank, 2, address, device)
    logits = [teacher_forced_logits(Path(model), tokens, prompt_len) for tokens, prompt_len in sequences]
    if rank == 0:
        torch.save(torch.cat(logits), out_path)
    destroy_tensor_parallel()


def teacher_forced(model: str, batch: list[list[int]], continuations: list[list[int]]) -> dict:
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    from common.ports import free_port

    sequences = [(p + c, len(p)) for p, c in zip(batch, continuations, strict=True)]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        reference = torch.cat([hf(torch.tensor([tokens], device="cuda")).logits[0, n - 1:-1].float().cpu()
                               for tokens, n in sequences])
    del hf
    torch.cuda.empty_cache()
    out_path = str(Path(tempfile.mkdtemp()) / "logits.pt")
    mp.start_processes(_teacher_forced_rank, args=(model, sequences, f"tcp://127.0.0.1:{free_port()}", out_path),
                       nprocs=2, start_method="spawn")
    ours = torch.load(out_path)
    relative_error = ((ours - reference).norm() / reference.norm()).item()
    agreement = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
    return {"positions": ours.shape[0], "top1_agreement": agreement, "relative_error": relative_error}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random-qwen3-0.6b")
    parser.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "nanovllm-bench"))
    parser.add_argument("--json-out")
    args = parser.parse_args()
    from bench.random_checkpoint import RANDOM_MODELS, make_random_checkpoint

    model = args.model
    if model in RANDOM_MODELS:
        model = str(make_random_checkpoint(Path(args.work_dir) / model, RANDOM_MODELS[model]))
    vocab_size = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    batch = prompts(vocab_size)
    results: dict = {}
    for mode, eager in (("graphs", False), ("eager", True)):
        one, two = greedy(model, batch, 1, eager), greedy(model, batch, 2, eager)
        same = sum(a == b for a, b in zip(one, two, strict=True))
        tokens = sum(x == y for a, b in zip(one, two, strict=True) for x, y in zip(a, b, strict=True))
        results[f"float32_greedy_{mode}"] = {"sequences_exact": same, "sequences": len(batch),
                                             "tokens_equal": tokens, "tokens": len(batch) * NUM_NEW_TOKENS}
        if mode == "graphs":
            continuations = one
    results["bfloat16_teacher_forced"] = teacher_forced(model, batch, continuations)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    for name, value in results.items():
        print(f"RESULT {name}: {json.dumps(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
