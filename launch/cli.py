"""The `nanovllm` command: `worker`, `scheduler`, `serve` (both on this machine) and `health`.

The flags are made from the config dataclasses (common/contract/config.py): their fields hold the defaults
and the help. Each command builds its configs and hands them to its service; no service imports
this module. Heavy imports happen inside each command, so that `nanovllm scheduler` never imports torch.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from common.contract.config import (
    ObservabilityConfig,
    PublicServerConfig,
    SchedulerConfig,
    WorkerConfig,
    WorkerLinkConfig,
)
from common.contract.config_flags import add_flags, config_from
from launch.log_format import configure_logging

DEFAULT_WORKER_PORT = 50061
# In `serve` the worker's flags of these names set the scheduler's limits too.
SHARED_LIMITS = ("max_num_seqs", "max_num_batched_tokens", "max_model_len")


def add_worker_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("worker")
    add_flags(group, WorkerConfig)
    group.add_argument("--cpu-kv-cache-gb", type=float, default=WorkerConfig.cpu_kv_cache_bytes / 2**30,
                       help="KV cache size on CPU, GiB")


def add_scheduler_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    group = parser.add_argument_group("scheduler")
    add_flags(group, SchedulerConfig, skip=skip)
    add_flags(group, ObservabilityConfig, skip=("log_level", "log_format"))
    group.add_argument("--tokenizer", help="tokenizer folder or .gguf (None: the worker's model path)")
    add_flags(parser.add_argument_group("public port"), PublicServerConfig)


def add_link_flags(parser: argparse.ArgumentParser, **flags: Any) -> None:
    group = parser.add_argument_group("worker link")
    group.add_argument("--worker-secret-file",
                       help="file holding the secret shared by scheduler and worker (None: $NANOVLLM_WORKER_SECRET); "
                            "never pass the secret itself on the command line")
    add_flags(group, WorkerLinkConfig, **flags)


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    model = args.model
    if not model:
        from common.formats.default_model import default_model_path

        model = default_model_path()
    return config_from(WorkerConfig, args, model=model, cpu_kv_cache_bytes=int(args.cpu_kv_cache_gb * 2**30))


def link_config(args: argparse.Namespace, prefix: str = "") -> WorkerLinkConfig:
    from common.security.worker_secret import load_secret

    return config_from(WorkerLinkConfig, args, prefix=prefix, secret=load_secret(args.worker_secret_file))


def check_health(args: argparse.Namespace) -> int:
    """grpc.health.v1 Check of the whole server at a public or a worker port (health needs no API
    key and no worker secret): 0 when SERVING (for container health checks), else 1 with one line
    saying why."""
    # gRPC logs a failed TLS handshake itself, ahead of our line; the error's details say it too.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    import grpc

    from common.client import GenerationClient

    tls = {"ca_cert": args.ca_cert, "client_cert": args.client_cert, "client_key": args.client_key}
    try:
        with GenerationClient(args.target, timeout=args.timeout, **tls) as client:
            status = client.health_status()
    except grpc.RpcError as error:
        # Plaintext to a TLS port, TLS to a plaintext one, a wrong CA or a missing client
        # certificate all fail the connection at once: UNAVAILABLE, the reason in the details.
        # A refused connection (nothing listens) is not about how it dialed.
        hint = ""
        if error.code() is grpc.StatusCode.UNAVAILABLE and "Connection refused" not in (error.details() or ""):
            hint = (" (dialed with TLS: a plaintext port takes no --ca-cert; mTLS needs --client-cert, --client-key)"
                    if any(tls.values()) else
                    " (dialed in plaintext: a TLS port needs --ca-cert; mTLS also --client-cert, --client-key)")
        print(f"{args.target}: {error.code().name}{hint}: {error.details()}", file=sys.stderr)
        return 1
    print(f"{args.target}: {status}")
    return 0 if status == "SERVING" else 1


def build_parser() -> argparse.ArgumentParser:
    formatter = argparse.ArgumentDefaultsHelpFormatter  # --help shows each default
    parser = argparse.ArgumentParser(prog="nanovllm", description=__doc__.splitlines()[0], formatter_class=formatter)
    add_flags(parser, ObservabilityConfig, skip=("metrics_port",))
    commands = parser.add_subparsers(dest="command", required=True)

    def add_parser(name: str, help: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=help, description=help, formatter_class=formatter)

    worker = add_parser("worker", "serve a model's worker (Step RPCs) on --host:--port")
    add_worker_flags(worker)
    worker.add_argument("--host", default="127.0.0.1",
                        help="address to bind (0.0.0.0 across hosts, then with TLS), or a unix socket path")
    worker.add_argument("--port", type=int, default=DEFAULT_WORKER_PORT, help="worker gRPC port")
    add_link_flags(worker, skip=("takeover",), names={"tls_ca": "--tls-client-ca"})

    scheduler = add_parser("scheduler", "serve the public API, driving running workers")
    add_scheduler_flags(scheduler)
    scheduler.add_argument("--worker", required=True,
                           help="worker address host:port (or unix:/path); several, comma-separated, for data "
                                "parallelism (each its own KV block pool)")
    add_link_flags(scheduler, prefix="worker-")

    health = add_parser("health", "exit 0 if the server at --target reports SERVING")
    health.add_argument("--target", default=f"127.0.0.1:{PublicServerConfig.port}",
                        help="host:port of a public or a worker port (over TLS: a name its certificate holds)")
    health.add_argument("--timeout", type=float, default=3.0, help="seconds")
    health.add_argument("--ca-cert", help="PEM CA that signs the port's certificate: TLS (None: plaintext)")
    health.add_argument("--client-cert", help="PEM client certificate, for a port that requires one (mTLS)")
    health.add_argument("--client-key", help="PEM key of --client-cert")

    serve = add_parser("serve", "start a worker and the scheduler on this machine")
    add_worker_flags(serve)
    add_scheduler_flags(serve, skip=SHARED_LIMITS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        observability = config_from(ObservabilityConfig, args)
        configure_logging(observability.log_level, observability.log_format)
        return _run(args, observability)
    except (ValueError, OSError) as error:  # one line, no traceback
        print(f"nanovllm {args.command}: {error}", file=sys.stderr)
        return 2 if isinstance(error, ValueError) else 1  # 2: a bad option value; 1: e.g. the port in use


def _run(args: argparse.Namespace, observability: ObservabilityConfig) -> int:
    if args.command == "health":
        return check_health(args)
    if args.command == "worker":
        from launch.worker import run_worker

        link = link_config(args)
        return run_worker(worker_config(args), link, args.host, args.port)
    scheduler, public = config_from(SchedulerConfig, args), config_from(PublicServerConfig, args)
    if args.command == "scheduler":
        from launch.scheduler import SchedulerServiceConfig, run_scheduler

        addresses = tuple(address.strip() for address in args.worker.split(",") if address.strip())
        return run_scheduler(SchedulerServiceConfig(scheduler, public, link_config(args, "worker-"), addresses,
                                                    observability, args.tokenizer))
    from launch.serve import run_serve

    return run_serve(worker_config(args), scheduler, public, observability, args.tokenizer)


if __name__ == "__main__":
    sys.exit(main())
