"""The `nanovllm` command: `worker`, `scheduler`, and `serve` (both on this machine).

Heavy imports happen inside each subcommand, so that `nanovllm scheduler` never imports torch.
"""
from __future__ import annotations

import argparse
import logging
import sys

DEFAULT_PORT = 50051
DEFAULT_WORKER_PORT = 50061


def add_worker_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("worker")
    group.add_argument("--model", help="Hugging Face checkpoint folder, or a .gguf file")
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    group.add_argument("--device", default="auto", help="cuda, cuda:N, cpu (auto: cuda if present)")
    group.add_argument("--block-size", type=int, default=256, help="tokens per KV block (a power of two >= 16)")
    group.add_argument("--max-model-len", type=int, default=4096, help="longest sequence, prompt and output")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    group.add_argument("--cpu-kv-cache-gb", type=float, default=1.0, help="KV cache size on CPU")
    group.add_argument("--num-kv-blocks", type=int, default=0, help="override the KV block count")
    group.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    group.add_argument("--cpu-weight-format", default="auto", choices=["auto", "float32", "int4"],
                       help="GGUF on CPU: int4 keeps 4-bit weights quantized (faster), float32 dequantizes")


def add_scheduler_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("scheduler")
    group.add_argument("--host", default="127.0.0.1", help="public address to bind (0.0.0.0 for all)")
    group.add_argument("--port", type=int, default=DEFAULT_PORT, help="public gRPC port")
    group.add_argument("--tokenizer", help="tokenizer folder or .gguf (default: the worker's model path)")
    group.add_argument("--max-queue-size", type=int, default=4096)
    group.add_argument("--no-prefix-caching", action="store_true")
    group.add_argument("--num-decode-steps", type=int, default=4,
                       help="decode iterations per step when only decodes run (tokens per stream message)")
    group.add_argument("--shutdown-grace", type=float, default=30.0,
                       help="seconds in-flight requests get to finish after SIGTERM")


def add_batch_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("batching")
    group.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one step")
    group.add_argument("--max-num-batched-tokens", type=int, default=16384, help="most tokens in one step")


def worker_config_from(args: argparse.Namespace):
    from common.config import WorkerConfig

    return WorkerConfig(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                        max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
                        cpu_kv_cache_bytes=int(args.cpu_kv_cache_gb * 2**30), num_kv_blocks=args.num_kv_blocks,
                        enforce_eager=args.enforce_eager, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        cpu_weight_format=args.cpu_weight_format)


def scheduler_config_from(args: argparse.Namespace):
    from common.config import SchedulerConfig

    return SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                           max_queue_size=args.max_queue_size, enable_prefix_caching=not args.no_prefix_caching,
                           num_decode_steps=args.num_decode_steps)


def check_health(target: str, timeout: float) -> int:
    """grpc.health.v1 Check of the whole server: 0 when SERVING (for container health checks)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    except grpc.RpcError as error:
        print(f"{target}: {error.code().name}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{target}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanovllm", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO")
    commands = parser.add_subparsers(dest="command", required=True)

    worker = commands.add_parser("worker", help="serve a model's worker (Step RPCs) on --worker-port")
    add_worker_options(worker)
    add_batch_options(worker)
    worker.add_argument("--host", default="127.0.0.1", help="address to bind, or a unix socket path")
    worker.add_argument("--port", type=int, default=DEFAULT_WORKER_PORT)

    scheduler = commands.add_parser("scheduler", help="serve the public API, driving running workers")
    add_scheduler_options(scheduler)
    add_batch_options(scheduler)
    scheduler.add_argument("--worker", required=True,
                           help="worker address host:port (or unix:/path); several, comma-separated, for data "
                                "parallelism (each its own KV block pool)")

    health = commands.add_parser("health", help="exit 0 if the server at --target reports SERVING")
    health.add_argument("--target", default=f"127.0.0.1:{DEFAULT_PORT}")
    health.add_argument("--timeout", type=float, default=3.0)

    serve = commands.add_parser("serve", help="start a worker and the scheduler on this machine")
    add_worker_options(serve)
    add_scheduler_options(serve)
    add_batch_options(serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _run(args)
    except ValueError as error:  # a bad option value: say which, without a traceback
        print(f"nanovllm {args.command}: {error}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.command == "worker":
        from worker_service.main import run_worker

        return run_worker(args)
    if args.command == "health":
        return check_health(args.target, args.timeout)
    if args.command == "scheduler":
        from scheduler_service.main import run_scheduler

        return run_scheduler(args)
    from scheduler_service.serve import run_serve

    return run_serve(args)


if __name__ == "__main__":
    sys.exit(main())
