"""A CPU worker beside another busy process: its decode throughput alone and contended, for each
OpenMP wait policy, so that the worker's default (launch/worker.py) is a measured choice.

    python bench/cpu_contention.py [--streams 8] [--new-tokens 64] [--weight-format float32] [--json-out F]

Each measurement runs in a fresh process (the wait policy is read once, when torch loads OpenMP): the
default model (SmolLM2-135M, GGUF) generates --streams greedy streams of --new-tokens tokens, once to
warm up, then timed. Neighbours: none; a spinner (one pure-Python busy loop); another torch process
multiplying matrices on every core with OpenMP's default (spinning) policy, the worst kind of
neighbour for a process whose threads meet at barriers. The ratio is contended / alone, same policy.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Each policy: the OpenMP environment the measured process runs with ({}: libgomp's defaults, which
# spin about 300,000 rounds at a barrier before sleeping).
POLICIES = {
    "libgomp default": {},
    "ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"},
    "PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "GOMP_SPINCOUNT=10000": {"GOMP_SPINCOUNT": "10000"},
    "GOMP_SPINCOUNT=1000": {"GOMP_SPINCOUNT": "1000"},
    "one thread": {"OMP_NUM_THREADS": "1"},
}
OPENMP_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")
NEIGHBOURS = {
    "none": None,
    "spinner": "while True: pass",
    "torch-matmul": "import torch\na = torch.randn(512, 512)\nwhile True: a @ a",
}


def measure_child(streams: int, new_tokens: int, weight_format: str) -> None:
    """In the child: prints the tokens per second of one timed generate."""
    sys.path.insert(0, str(REPO))
    from common import SamplingParams
    from common.formats.default_model import default_model_path
    from offline import LLM

    llm = LLM(default_model_path(), device="cpu", cpu_weight_format=weight_format)
    prompts = [f"Question {i}: tell me about the sea." for i in range(streams)]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    print(json.dumps({"tok_s": streams * new_tokens / (time.perf_counter() - started)}))


def run_once(policy: str, neighbour: str, args: argparse.Namespace) -> float:
    defaults = {key: value for key, value in os.environ.items() if key not in OPENMP_VARIABLES}
    env = {**defaults, **POLICIES[policy]}
    busy = None
    if NEIGHBOURS[neighbour] is not None:  # the neighbour keeps OpenMP's defaults
        busy = subprocess.Popen([sys.executable, "-c", NEIGHBOURS[neighbour]], env=defaults)
    try:
        child = subprocess.run([sys.executable, __file__, "--child", "--streams", str(args.streams), "--new-tokens",
                                str(args.new_tokens), "--weight-format", args.weight_format],
                               env=env, capture_output=True, text=True, check=True)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    return json.loads(child.stdout.strip().splitlines()[-1])["tok_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--weight-format", default="float32", choices=("float32", "int4"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, of: " + ", ".join(POLICIES))
    parser.add_argument("--json-out", help="write the table as JSON here too")
    args = parser.parse_args()
    if args.child:
        measure_child(args.streams, args.new_tokens, args.weight_format)
        return
    rows = []
    print(f"{args.streams} streams x {args.new_tokens} tokens, {args.weight_format} weights, {os.cpu_count()} CPUs")
    print(f"{'OpenMP policy':>22} {'neighbour':>14} {'tok/s':>8} {'vs alone':>9}")
    for policy in args.policies.split(","):
        alone = None
        for neighbour in NEIGHBOURS:
            rate = run_once(policy, neighbour, args)
            alone = rate if alone is None else alone
            rows.append({"policy": policy, "neighbour": neighbour, "tok_s": rate, "vs_alone": rate / alone})
            print(f"{policy:>22} {neighbour:>14} {rate:8.1f} {rate / alone:9.2f}", flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
