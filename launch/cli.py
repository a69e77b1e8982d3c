"""The `nanovllm` command: `worker`, `scheduler`, `serve` (both on this machine) and `health`.

The flags are made from the config dataclasses (common/contract/config.py): their fields hold the defaults
and the help. Each command builds its configs and hands them to its service; no service imports
this module. Heavy imports happen inside each command, so that `nanovllm scheduler` never imports torch.
"""
from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import io
import ipaddress
import os
import re
import signal
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
USAGE_ERROR = 2  # exit code of a bad flag or value, as argparse's own
GLOBAL_FLAGS = ("log_level", "log_format")  # accepted before the subcommand and after it
WORKER_ADDRESS_FORMS = "host:port, [ipv6]:port or unix:/path"
# The worker's --tls-client-ca: WorkerLinkConfig.tls_ca's help says the scheduler's meaning.
WORKER_TLS_CLIENT_CA_HELP = ("PEM CA bundle: require scheduler certificates it signed (mutual TLS; with --tls-cert "
                             "and --tls-key)")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each default, but not an empty one (None, ""; the help says what its absence means)
    and marks required flags as required."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help = action.help or ""
        if action.required:
            return f"{help} (required)"
        if action.default is None or action.default == "":
            return help
        return super()._get_help_string(action)
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


def add_global_flags(parser: argparse.ArgumentParser) -> None:
    """The global flags again on a subcommand, so that they may follow it too (`nanovllm serve --log-level
    DEBUG`); their default there is no value, so that one given before the subcommand stays."""
    add_flags(parser.add_argument_group("logging"), ObservabilityConfig,
              skip=tuple(f.name for f in dataclasses.fields(ObservabilityConfig) if f.name not in GLOBAL_FLAGS))
    for action in parser._actions:
        if action.dest in GLOBAL_FLAGS:
            action.default = argparse.SUPPRESS


def add_link_flags(parser: argparse.ArgumentParser, **flags: Any) -> None:
    group = parser.add_argument_group("worker link")
    group.add_argument("--worker-secret-file",
                       help="file holding the secret shared by scheduler and worker (None: $NANOVLLM_WORKER_SECRET); "
                            "never pass the secret itself on the command line")
    add_flags(group, WorkerLinkConfig, **flags)


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    """The worker's config from its flags (no --model: the default model), the model as given."""
    model = args.model
    if not model:
        from common.formats.default_model import default_model_path

        model = default_model_path()
    return config_from(WorkerConfig, args, model=model, cpu_kv_cache_bytes=int(args.cpu_kv_cache_gb * 2**30))


def checked_worker_config(args: argparse.Namespace) -> WorkerConfig:
    """worker_config with its model resolved (common.formats.checkpoint.resolve_model: an existing
    checkpoint, or a hub id's snapshot in the local Hugging Face cache); ModelNotFoundError otherwise."""
    from common.formats.checkpoint import resolve_model

    config = worker_config(args)
    return dataclasses.replace(config, model=resolve_model(config.model, "--model"))


def worker_addresses(value: str) -> tuple[str, ...]:
    """The --worker addresses (comma-separated), each host:port, [ipv6]:port or unix:/path; ValueError,
    one line naming the flag and the address, for any other."""
    addresses = tuple(address.strip() for address in value.split(",") if address.strip())
    if not addresses:
        raise ValueError(f"--worker: {value!r} names no address ({WORKER_ADDRESS_FORMS})")
    for address in addresses:
        problem = _worker_address_problem(address)
        if problem:
            raise ValueError(f"--worker: {address}: {problem} (give {WORKER_ADDRESS_FORMS})")
    return addresses


def _worker_address_problem(address: str) -> str | None:
    if address.startswith("unix:"):
        return None if address.removeprefix("unix:").strip("/") else "no socket path after unix:"
    if "://" in address:
        return f"a URL, not an address (gRPC takes no {address.split('://', 1)[0]}:// scheme)"
    bracketed = re.fullmatch(r"\[([^\]]*)\](?::(.*))?", address)
    if bracketed:
        host, port = bracketed.group(1), bracketed.group(2)
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return f"{host!r} is not an IPv6 address"
    elif address.count(":") > 1:
        return "an IPv6 address goes in brackets, [address]:port"
    else:
        host, _, port = address.partition(":")
        if not host:
            return "no host"
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", host):
            return f"{host!r} is not a host name or address"
        port = port if ":" in address else None
    if port is None or port == "":
        return "no port"
    if not port.isdigit():
        return f"port {port!r} is not a number"
    if not 1 <= int(port) <= 65535:
        return f"port {port} is not in [1, 65535]"
    return None


def tokenizer_path(args: argparse.Namespace) -> str | None:
    """--tokenizer resolved as --model is (None when not given)."""
    from common.formats.checkpoint import resolve_model

    return None if args.tokenizer is None else resolve_model(args.tokenizer, "--tokenizer", tokenizer=True)


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
        print(f"{args.target}: {_health_failure(args, error, any(tls.values()))}", file=sys.stderr)
        return 1
    print(f"{args.target}: {status}")
    return 0 if status == "SERVING" else 1


def _health_failure(args: argparse.Namespace, error: Any, tls: bool) -> str:
    """What went wrong, in one line (common.client.connection_failure). A port that does not speak
    TLS is dialed once more in plaintext, to tell a plaintext gRPC port from no gRPC server at all."""
    import grpc

    from common.client import GenerationClient, connection_failure

    line = connection_failure(error, tls=tls, client_cert=args.client_cert is not None)
    if tls and "WRONG_VERSION_NUMBER" in (error.details() or ""):
        try:
            with GenerationClient(args.target, timeout=min(args.timeout, 3.0)) as client:
                client.health_status()
        except grpc.RpcError as plaintext_error:
            plaintext = connection_failure(plaintext_error, tls=False)
            if "not a gRPC server" in plaintext:
                return plaintext
    return line


def build_parser() -> argparse.ArgumentParser:
    formatter = HelpFormatter  # --help shows each default
    parser = argparse.ArgumentParser(prog="nanovllm", description=__doc__.splitlines()[0], formatter_class=formatter)
    add_flags(parser, ObservabilityConfig, skip=("metrics_port",))
    commands = parser.add_subparsers(dest="command", required=True)

    def add_parser(name: str, help: str) -> argparse.ArgumentParser:
        command = commands.add_parser(name, help=help, description=help, formatter_class=formatter)
        add_global_flags(command)
        return command

    worker = add_parser("worker", "serve a model's worker (Step RPCs) on --host:--port")
    add_worker_flags(worker)
    worker.add_argument("--host", default="127.0.0.1",
                        help="address to bind (0.0.0.0 across hosts, then with TLS), or a unix socket path")
    worker.add_argument("--port", type=int, default=DEFAULT_WORKER_PORT, help="worker gRPC port")
    add_link_flags(worker, skip=("takeover",), names={"tls_ca": "--tls-client-ca"},
                   helps={"tls_ca": WORKER_TLS_CLIENT_CA_HELP})

    scheduler = add_parser("scheduler", "serve the public API, driving running workers")
    add_scheduler_flags(scheduler)
    scheduler.add_argument("--worker", required=True,
                           help="worker address host:port (or unix:/path); several, comma-separated, for data "
                                "parallelism (each its own KV block pool)")
    add_link_flags(scheduler, prefix="worker-", skip=("session_lease_s",))

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


def _print_stacks_on_sigusr1() -> None:
    """`kill -USR1 <pid>` prints every thread's stack to stderr: what a process that seems stuck is
    doing. Not where stderr is no file (main() called under a test's captured output)."""
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (AttributeError, ValueError, io.UnsupportedOperation):
        pass


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _print_stacks_on_sigusr1()
    try:
        observability = config_from(ObservabilityConfig, args)
        configure_logging(observability.log_level, observability.log_format)
        return _run(args, observability)
    except (ValueError, OSError) as error:  # one line, no traceback
        print(f"nanovllm {args.command}: {error}", file=sys.stderr)
        # USAGE_ERROR: a bad flag or value (a missing model is both, ModelNotFoundError); 1: e.g. a port in use
        return USAGE_ERROR if isinstance(error, ValueError) else 1


def _run(args: argparse.Namespace, observability: ObservabilityConfig) -> int:
    if args.command == "health":
        return check_health(args)
    if args.command == "worker":
        from launch.worker import run_worker

        link = link_config(args)
        return run_worker(checked_worker_config(args), link, args.host, args.port)
    # Every address and path is checked here, before anything starts: ValueError, exit USAGE_ERROR.
    scheduler, public = config_from(SchedulerConfig, args), config_from(PublicServerConfig, args)
    if args.command == "scheduler":
        from launch.scheduler import SchedulerServiceConfig, run_scheduler

        addresses, tokenizer = worker_addresses(args.worker), tokenizer_path(args)
        return run_scheduler(SchedulerServiceConfig(scheduler, public, link_config(args, "worker-"), addresses,
                                                    observability, tokenizer))
    from launch.serve import run_serve

    worker, tokenizer = checked_worker_config(args), tokenizer_path(args)
    return run_serve(worker, scheduler, public, observability, tokenizer)


if __name__ == "__main__":
    sys.exit(main())
