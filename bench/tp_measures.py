"""Measurements run on an offline LLM after bench/throughput.py's timed runs: single-stream latency,
and a torch.profiler summary of decode steps (collectives against the rest, on rank 0's GPU)."""
from __future__ import annotations

import time
from pathlib import Path

from common import SamplingParams

PROMPT_LEN = 128
COLLECTIVE_WORDS = ("nccl", "all_reduce", "allreduce")  # in the names of the collectives' kernels


def single_stream_latency(llm, num_tokens: int) -> dict:
    """One request alone: time to first token, and mean inter-token latency over num_tokens more."""
    def timed(max_tokens: int, offset: int) -> float:
        llm.engine.reset_prefix_cache()
        prompt = [(offset * 131 + i * 7) % 500 + 1 for i in range(PROMPT_LEN)]  # within any vocabulary
        started = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - started

    timed(num_tokens // 4 + 1, 0)  # warm-up
    ttft = min(timed(1, 1), timed(1, 2))
    total = timed(num_tokens + 1, 3)
    return {"ttft_s": ttft, "itl_ms": (total - ttft) / num_tokens * 1e3, "num_tokens": num_tokens}


def profile_decode(llm, path: str, num_seqs: int = 64, num_tokens: int = 64) -> dict:
    """Profiles num_seqs requests of num_tokens (mostly decode steps); writes the kernel table to
    path and returns the kernel time of the collectives (NCCL's, symmetric memory's) and of everything else."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    prompts = [[(s * 131 + i * 7) % 500 + 1 for i in range(PROMPT_LEN)] for s in range(num_seqs)]
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    llm.engine.reset_prefix_cache()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
    events = prof.key_averages()

    def device_us(event) -> float:
        return float(getattr(event, "self_device_time_total", 0) or getattr(event, "self_cuda_time_total", 0))

    # Kernels only (operator rows carry their kernels' time again); the sums' kernels are NCCL's or
    # symmetric memory's (two_shot_all_reduce_kernel).
    kernels = [e for e in events if device_us(e) > 0 and e.device_type == torch.autograd.DeviceType.CUDA]
    collectives = sum(device_us(e) for e in kernels if any(word in e.key.lower() for word in COLLECTIVE_WORDS))
    total = sum(device_us(e) for e in kernels)
    sort_key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    Path(path).write_text(events.table(sort_by=sort_key, row_limit=30))
    return {"wall_s": wall, "device_total_ms": total / 1e3, "collectives_ms": collectives / 1e3,
            "compute_ms": (total - collectives) / 1e3, "collective_fraction": collectives / total if total else None}
