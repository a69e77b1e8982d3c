"""Where the GPU time of a generation goes: runs a slice of the reference workload in-process under
torch.profiler and prints the kernels that take the most device time.

    python bench/profile_decode.py [--num-seqs 128] [--max-len 512]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.random_checkpoint import make_random_checkpoint
    from bench.workload import bench_workload
    from common import SamplingParams
    from scheduler_service import LLM

    parser = argparse.ArgumentParser()
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=384)
    parser.add_argument("--work-dir", default="/tmp/nanovllm-bench")
    args = parser.parse_args()
    model = make_random_checkpoint(Path(args.work_dir) / "random-qwen3-0.6b")
    llm = LLM(str(model), max_model_len=4096)
    prompts, max_tokens = bench_workload(args.num_seqs, args.max_len, args.max_len)
    params = [SamplingParams(temperature=0.6, max_tokens=m, ignore_eos=True) for m in max_tokens]
    llm.generate(prompts[:8], params[:8], use_tqdm=False)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))
    return 0


if __name__ == "__main__":
    sys.exit(main())
