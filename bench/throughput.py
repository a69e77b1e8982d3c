"""Throughput on the reference offline workload: in-process (the offline LLM) and through the gRPC
services (worker and scheduler processes started by the `nanovllm` CLI, all requests sent at once
by an asyncio client; the scheduler records and serves its Prometheus metrics, except in
grpc-no-metrics), the same services through the public port's vllm.grpc.engine.VllmEngine.Generate
(vllm-grpc: the dialect of the Shepherd Model Gateway, the same token ids), and the first 32
requests through transformers' continuous batching.

    python bench/throughput.py --model random-qwen3-0.6b            # on a GPU: the reference run
    python bench/throughput.py --model PATH --num-seqs 16 --max-input-len 128 --max-output-len 64
    python bench/throughput.py --model random-qwen3-8b --modes inprocess --tensor-parallel-size 2 --itl-tokens 256
    python bench/throughput.py --modes grpc --num-workers 2    # data parallelism: one GPU per worker
    python bench/throughput.py --modes grpc,grpc-no-metrics    # what recording the metrics costs
    python bench/throughput.py --modes inprocess,grpc,vllm-grpc --hf-num-seqs 0   # our API vs VllmEngine

Each mode runs in its own process (so that each has the whole GPU); output tok/s counts output
tokens over wall time, prefill included, after a warm-up. The last lines are a table.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench.memory_floor import decode_floor_seconds  # noqa: E402
from bench.workload import bench_workload  # noqa: E402
from worker_service.models.config import ModelConfig  # noqa: E402

RESULT_PREFIX = "RESULT "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random-qwen3-0.6b",
                        help="checkpoint path, or random-qwen3-0.6b / random-qwen3-8b (built under --work-dir)")
    parser.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "nanovllm-bench"))
    parser.add_argument("--modes", default="inprocess,grpc,hf",
                        help="comma-separated: inprocess, grpc, grpc-no-metrics, vllm-grpc, hf")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--hf-num-seqs", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--deterministic", action="store_true", help="batch-invariant kernels (the worker's flag)")
    parser.add_argument("--attention-backend", default="auto",
                        help="the worker's attention backend (auto: its default)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                        help="fp8: e4m3 KV cache (half the K/V bytes of bf16)")
    parser.add_argument("--num-decode-steps", type=int, default=4, help="decode iterations per step")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--num-workers", type=int, default=1,
                        help="grpc mode: workers (data parallelism), worker i on GPU i (CUDA_VISIBLE_DEVICES)")
    parser.add_argument("--itl-tokens", type=int, default=0,
                        help="in-process mode: then time one stream of this many tokens (inter-token latency)")
    parser.add_argument("--torch-profile", help="in-process mode: then profile decode steps, summary to this file")
    parser.add_argument("--run-mode", help=argparse.SUPPRESS)  # internal: one mode in this process
    parser.add_argument("--json-out", help="write all results as JSON here")
    parser.add_argument("--profile", help="in-process mode: write a cProfile of the timed run here")
    return parser.parse_args(argv)


def resolve_model(args: argparse.Namespace) -> str:
    from bench.random_checkpoint import RANDOM_MODELS, random_model_folder

    if args.model not in RANDOM_MODELS:
        return args.model
    return str(random_model_folder(Path(args.work_dir), args.model))


def workload(args: argparse.Namespace) -> tuple[list[list[int]], list[int]]:
    return bench_workload(args.num_seqs, args.max_input_len, args.max_output_len)


def timed_slices(args: argparse.Namespace) -> dict[str, tuple[list[list[int]], list[int]]]:
    """(prompts, max_tokens) of the timed runs: all requests, and the first --hf-num-seqs ("hf_slice")."""
    prompts, max_tokens = workload(args)
    slices = {"all": (prompts, max_tokens)}
    if args.hf_num_seqs:  # 0: no slice (--hf-num-seqs 0 with no hf mode)
        slices["hf_slice"] = (prompts[:args.hf_num_seqs], max_tokens[:args.hf_num_seqs])
    return slices


def engine_options(args: argparse.Namespace) -> dict:
    return dict(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                enforce_eager=args.enforce_eager, device=args.device, num_decode_steps=args.num_decode_steps,
                kv_cache_dtype=args.kv_cache_dtype, tensor_parallel_size=args.tensor_parallel_size,
                deterministic=args.deterministic, attention_backend=args.attention_backend)


# Modes, each run in its own process.

def run_inprocess(args: argparse.Namespace, model: str) -> dict:
    from common import SamplingParams
    from offline import LLM

    llm = LLM(model, **engine_options(args))
    llm.generate([[1] * 100] * 8, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    results = {}
    for name, (prompts, max_tokens) in timed_slices(args).items():
        params = [SamplingParams(temperature=args.temperature, max_tokens=m, ignore_eos=True) for m in max_tokens]
        profiler = _profiler(args.profile if name == "all" else None)
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.profile)
        results[name] = {"output_tokens": sum(len(o["token_ids"]) for o in outputs), "seconds": elapsed}
        llm.engine.reset_prefix_cache()  # the next run starts cold, like the reference
    results["num_kv_blocks"] = llm.engine.stats().num_kv_blocks
    results["num_preemptions"] = llm.engine.stats().num_preemptions
    if args.itl_tokens:
        from bench.tp_measures import single_stream_latency

        results["single_stream"] = single_stream_latency(llm, args.itl_tokens)
    if args.torch_profile:
        from bench.tp_measures import profile_decode

        results["profile"] = profile_decode(llm, args.torch_profile)
    llm.close()
    return results


def _profiler(path: str | None):
    if not path:
        return None
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    return profiler


def run_grpc(args: argparse.Namespace, model: str) -> dict:
    from tests.services_harness import cli, free_port, stop

    worker_ports, port = [free_port() for _ in range(args.num_workers)], free_port()
    workers = [_start_worker(args, model, worker_port, index if args.num_workers > 1 else None)
               for index, worker_port in enumerate(worker_ports)]
    addresses = ",".join(f"127.0.0.1:{worker_port}" for worker_port in worker_ports)
    metrics_port = 0 if args.run_mode == "grpc-no-metrics" else free_port()  # 0: no recording
    scheduler = cli("scheduler", "--worker", addresses, "--port", str(port), "--metrics-port", str(metrics_port),
                    "--max-num-seqs", str(args.max_num_seqs),
                    "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                    "--num-decode-steps", str(args.num_decode_steps))
    client = _vllm_engine_client if args.run_mode == "vllm-grpc" else _grpc_client
    try:
        return asyncio.run(client(args, f"127.0.0.1:{port}"))
    finally:
        stop(scheduler)
        for worker in workers:
            stop(worker)


def _start_worker(args: argparse.Namespace, model: str, port: int, gpu: int | None) -> subprocess.Popen:
    """A `nanovllm worker`; on GPU `gpu` alone when given (data parallelism: one GPU per worker)."""
    from common.security.worker_secret import SECRET_ENV
    from tests.services_harness import WORKER_SECRET

    flags = ["--model", model, "--port", str(port), "--max-model-len", str(args.max_model_len),
             "--block-size", str(args.block_size), "--device", args.device,
             "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--tensor-parallel-size", str(args.tensor_parallel_size),
             *(["--enforce-eager"] if args.enforce_eager else []),
             "--attention-backend", args.attention_backend, "--kv-cache-dtype", args.kv_cache_dtype,
             *(["--deterministic"] if args.deterministic else [])]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", SECRET_ENV: WORKER_SECRET}
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return subprocess.Popen([sys.executable, "-m", "launch.cli", "--log-level", "WARNING", "worker", *flags],
                            cwd=REPO_ROOT, env=env)


async def _grpc_client(args: argparse.Namespace, target: str) -> dict:
    import grpc

    from common.client import GenerationClient, build_request
    from common.generated.nanovllm.generate.v1 import generate_pb2_grpc
    from common.net.grpc_options import channel_options

    with GenerationClient(target) as client:
        client.wait_ready(timeout=600)
    async with grpc.aio.insecure_channel(target, options=channel_options()) as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        warmup = [build_request([1] * 100, max_tokens=16, ignore_eos=True) for _ in range(8)]
        await asyncio.gather(*(stub.Generate(r) for r in warmup))
        results = {}
        for name, (prompts, max_tokens) in timed_slices(args).items():
            requests = [build_request(p, max_tokens=m, temperature=args.temperature, ignore_eos=True)
                        for p, m in zip(prompts, max_tokens, strict=True)]
            started = time.perf_counter()
            responses = await asyncio.gather(*(stub.Generate(r) for r in requests))
            elapsed = time.perf_counter() - started
            results[name] = {"output_tokens": sum(len(r.token_ids) for r in responses), "seconds": elapsed}
        return results


async def _vllm_engine_client(args: argparse.Namespace, target: str) -> dict:
    """The same requests through vllm.grpc.engine.VllmEngine.Generate, unary (stream false: one
    complete with every output id), as the grpc mode's TextGeneration.Generate."""
    import grpc
    from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

    from common.client import GenerationClient
    from common.net.grpc_options import channel_options

    def request(prompt: list[int], max_tokens: int, temperature: float) -> vllm_engine_pb2.GenerateRequest:
        return vllm_engine_pb2.GenerateRequest(
            tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt), stream=False,
            sampling_params=vllm_engine_pb2.SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                                           ignore_eos=True))

    async def generate(stub: vllm_engine_pb2_grpc.VllmEngineStub, message: vllm_engine_pb2.GenerateRequest) -> int:
        (response,) = [r async for r in stub.Generate(message)]
        return len(response.complete.output_ids)

    with GenerationClient(target) as client:
        client.wait_ready(timeout=600)
    async with grpc.aio.insecure_channel(target, options=channel_options()) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        await asyncio.gather(*(generate(stub, request([1] * 100, 16, 1.0)) for _ in range(8)))
        results = {}
        for name, (prompts, max_tokens) in timed_slices(args).items():
            requests = [request(p, m, args.temperature) for p, m in zip(prompts, max_tokens, strict=True)]
            started = time.perf_counter()
            counts = await asyncio.gather(*(generate(stub, r) for r in requests))
            elapsed = time.perf_counter() - started
            results[name] = {"output_tokens": sum(counts), "seconds": elapsed}
        return results


def run_hf(args: argparse.Namespace, model: str) -> dict:
    """transformers' continuous batching (paged|sdpa) on the first requests, the same sampling."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16, attn_implementation="paged|sdpa")
    hf = hf.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    config = GenerationConfig(max_new_tokens=args.max_output_len, do_sample=True, temperature=args.temperature,
                              top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=0)
    prompts, max_tokens = timed_slices(args)["hf_slice"]
    manager = hf.init_continuous_batching(generation_config=config)
    manager.start()
    try:
        started = time.perf_counter()
        for index, (prompt, limit) in enumerate(zip(prompts, max_tokens, strict=True)):
            manager.add_request(prompt, request_id=str(index), max_new_tokens=limit)
        outputs = {}
        while len(outputs) < len(prompts):
            result = manager.get_result(timeout=600)
            if result is None:
                raise RuntimeError("transformers' continuous batching stopped without finishing")
            if result.is_finished() if hasattr(result, "is_finished") else True:
                outputs[result.request_id] = result
        elapsed = time.perf_counter() - started
    finally:
        manager.stop(block=True)
    return {"hf_slice": {"output_tokens": sum(len(o.generated_tokens) for o in outputs.values()),
                         "seconds": elapsed}}


# Ceiling and report.

def measure_copy_bandwidth() -> float | None:
    """Device copy bandwidth in bytes/s (read + write), or None without CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    source = torch.randn(1 << 30, device="cuda", dtype=torch.float32)  # 4 GiB
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        target.copy_(source)
    end.record()
    end.synchronize()
    return 10 * 2 * source.numel() * 4 / (start.elapsed_time(end) / 1e3)


def bandwidth_floor_seconds(args: argparse.Namespace, model: str, bandwidth: float) -> float:
    """The memory floor of the decode phase (bench/memory_floor): every iteration reads the weights
    (of a MoE, the experts its batch touches) and each running sequence's K/V once."""
    prompts, max_tokens = workload(args)
    config = ModelConfig.from_hf_folder(model)
    return decode_floor_seconds(config, [len(p) for p in prompts], max_tokens, bandwidth, args.kv_cache_dtype == "fp8")


def run_mode_in_subprocess(args: argparse.Namespace, mode: str, argv: list[str]) -> dict | None:
    command = [sys.executable, str(Path(__file__).resolve()), *argv, "--run-mode", mode]
    process = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)
    sys.stderr.write(process.stderr[-4000:])
    for line in process.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    print(f"mode {mode} failed (exit {process.returncode})", file=sys.stderr)
    return None


def tok_s(entry: dict | None) -> float | None:
    return entry["output_tokens"] / entry["seconds"] if entry else None


def report(args: argparse.Namespace, model: str, results: dict, bandwidth: float | None) -> None:
    rows = []
    for mode in ("inprocess", "grpc", "grpc-no-metrics", "vllm-grpc"):
        if results.get(mode):
            entry = results[mode]["all"]
            rows.append((f"{mode}, {args.num_seqs} requests", entry["output_tokens"], entry["seconds"], tok_s(entry)))
    for mode in ("inprocess", "grpc", "grpc-no-metrics", "vllm-grpc", "hf"):
        if results.get(mode) and "hf_slice" in results[mode]:
            entry = results[mode]["hf_slice"]
            label = "transformers CB" if mode == "hf" else mode
            rows.append((f"{label}, first {args.hf_num_seqs}", entry["output_tokens"], entry["seconds"], tok_s(entry)))
    print()
    print(f"{Path(args.model).name}, tensor parallel {args.tensor_parallel_size}, {args.num_workers} worker(s) in grpc")
    print(f"{'configuration':36} {'out tokens':>10} {'seconds':>9} {'tok/s':>10}")
    for name, tokens, seconds, rate in rows:
        print(f"{name:36} {tokens:>10} {seconds:>9.2f} {rate:>10.0f}")
    inproc, grpc_ = results.get("inprocess"), results.get("grpc")
    if inproc and inproc.get("single_stream"):
        single = inproc["single_stream"]
        print(f"single stream: TTFT {single['ttft_s'] * 1e3:.1f} ms, ITL {single['itl_ms']:.2f} ms")
    if inproc and inproc.get("profile"):
        prof = inproc["profile"]
        print(f"profile (rank 0 GPU): collectives {prof['collectives_ms']:.1f} ms, rest {prof['compute_ms']:.1f} ms "
              f"of kernel time, over {prof['wall_s']:.2f} s wall")
    if inproc and grpc_:
        print(f"gRPC / in-process: {tok_s(grpc_['all']) / tok_s(inproc['all']):.3f}")
    if grpc_ and results.get("vllm-grpc"):
        print(f"VllmEngine.Generate / our Generate: {tok_s(results['vllm-grpc']['all']) / tok_s(grpc_['all']):.4f}")
    if grpc_ and results.get("grpc-no-metrics"):
        print(f"gRPC with metrics / without: {tok_s(grpc_['all']) / tok_s(results['grpc-no-metrics']['all']):.4f}")
    if inproc and results.get("hf") and "hf_slice" in inproc:
        print(f"ours / transformers CB (first {args.hf_num_seqs}): "
              f"{tok_s(inproc['hf_slice']) / tok_s(results['hf']['hf_slice']):.1f}x")
    if bandwidth and inproc and (Path(model) / "config.json").exists():
        floor = bandwidth_floor_seconds(args, model, bandwidth)
        print(f"measured copy bandwidth {bandwidth / 1e12:.2f} TB/s; decode memory floor {floor:.2f} s; "
              f"in-process reaches {floor / inproc['all']['seconds']:.2f} of the bandwidth ceiling")


def main() -> int:
    argv = sys.argv[1:]
    args = parse_args(argv)
    model = resolve_model(args)
    if args.run_mode:
        runners = {"inprocess": run_inprocess, "grpc": run_grpc, "grpc-no-metrics": run_grpc, "vllm-grpc": run_grpc,
                   "hf": run_hf}
        runner = runners[args.run_mode]
        print(RESULT_PREFIX + json.dumps(runner(args, model)), flush=True)
        return 0
    results = {mode: run_mode_in_subprocess(args, mode, argv) for mode in args.modes.split(",")}
    bandwidth = measure_copy_bandwidth()
    results["copy_bandwidth_bytes_per_s"] = bandwidth
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    report(args, model, results, bandwidth)
    return 0


if __name__ == "__main__":
    sys.exit(main())
