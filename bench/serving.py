"""Serving benchmark: an open-loop client against a running service, TTFT / ITL / e2e under load.

    python bench/serving.py --target 127.0.0.1:50051 --request-rates 4,8,16,32,inf \\
        --json-out serving.json --plot serving.png

For each request rate (requests/s, Poisson arrivals; inf sends them all at once) the same
--num-prompts requests are streamed (GenerateStream, EOS ignored, so every request generates its
max_tokens), optionally at most --max-concurrency at a time; then a single-stream point per
--single-stream-prompt-lens. Prompt and output lengths follow the reference workload
(bench/workload.py: uniform in 100..max) or are fixed (--input-len / --output-len). Reports per
rate throughput, TTFT, inter-token latency, TPOT and e2e percentiles, and goodput: requests/s
meeting the stated SLO (--slo-ttft-ms, --slo-tpot-ms). Needs the bench extra (matplotlib) for --plot,
checked before anything runs.

A secured service (the scheduler's --tls-cert, --api-key-file) is measured as the client reaches it:

    python bench/serving.py --target api.example:50051 --ca-cert ca.pem --api-key-file key.txt

(or the key in $NANOVLLM_API_KEY; mTLS adds --client-cert and --client-key).
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import random
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import grpc  # noqa: E402

from bench.serving_stats import RequestTiming, Slo, distribution_ms, plot, summarize, table  # noqa: E402
from bench.workload import bench_workload  # noqa: E402
from common.client import build_request  # noqa: E402
from common.generated.nanovllm.generate.v1 import generate_pb2, generate_pb2_grpc  # noqa: E402
from common.net.grpc_options import channel_options  # noqa: E402
from common.security.tls import channel_credentials, read_file  # noqa: E402

Workload = list[tuple[list[int], int]]  # (prompt token ids, max_tokens)
Metadata = tuple[tuple[str, str], ...]
API_KEY_ENV = "NANOVLLM_API_KEY"  # as the client's examples: the key of one client
# Optional dependencies: (module, the option that needs it, how to get it).
OPTIONAL_DEPENDENCIES = (("matplotlib", "plot", "pip install -e '.[bench]' (or pip install matplotlib)"),)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each default, but not "(default: None)": those options say what leaving them out means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=_HelpFormatter)
    parser.add_argument("--target", default="127.0.0.1:50051",
                        help="the service's public address host:port (over TLS: a name its certificate holds)")
    parser.add_argument("--ca-cert", help="PEM CA that signs the service's certificate: TLS (None: plaintext)")
    parser.add_argument("--client-cert", help="PEM client certificate, for a service that requires one (mTLS)")
    parser.add_argument("--client-key", help="PEM key of --client-cert")
    parser.add_argument("--api-key-file", help=f"file holding the API key (its first line that is not blank or a "
                        f"# comment), sent as 'authorization: Bearer <key>' (None: ${API_KEY_ENV} if set)")
    parser.add_argument("--request-rates", default="4,8,16,32,inf",
                        help="comma-separated requests/s (Poisson arrivals); inf sends all at once")
    parser.add_argument("--max-concurrency", type=int, default=0, help="most requests in flight (0: no limit)")
    parser.add_argument("--num-prompts", type=int, default=256, help="requests per rate")
    parser.add_argument("--dataset", choices=["reference", "fixed"], default="reference",
                        help="reference: lengths uniform in 100..max (bench/workload.py); fixed: --input-len etc.")
    parser.add_argument("--max-input-len", type=int, default=1024,
                        help="reference dataset: longest prompt, tokens")
    parser.add_argument("--max-output-len", type=int, default=1024,
                        help="reference dataset: longest output, tokens")
    parser.add_argument("--input-len", type=int, default=1024, help="fixed dataset: prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="fixed dataset: output tokens")
    parser.add_argument("--temperature", type=float, default=0.6, help="sampling temperature of every request")
    parser.add_argument("--seed", type=int, default=0, help="arrival times and fixed prompts")
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="goodput: most time to first token, ms")
    parser.add_argument("--slo-tpot-ms", type=float, default=50.0, help="goodput: most time per output token, ms")
    parser.add_argument("--single-stream-prompt-lens", default="512,2048",
                        help="comma-separated prompt lengths for single-stream points ('' for none)")
    parser.add_argument("--single-stream-output-len", type=int, default=256,
                        help="single-stream points: output tokens")
    parser.add_argument("--single-stream-repeats", type=int, default=5,
                        help="single-stream points: requests per prompt length")
    parser.add_argument("--num-warmup", type=int, default=8, help="short requests before measuring")
    parser.add_argument("--json-out", help="write the results here")
    parser.add_argument("--plot", help="write the latency-throughput plot (PNG) here")
    parser.add_argument("--from-json", help="no run: print the table and plot the results of an earlier --json-out "
                        "(e.g. on a machine with matplotlib, after a GPU run)")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for SERVING")
    return parser.parse_args(argv)


def check_optional_dependencies(args: argparse.Namespace) -> str | None:
    """The problem with a missing optional dependency that an option needs, None when all are there:
    found before the run, not after minutes of it."""
    for module, option, install in OPTIONAL_DEPENDENCIES:
        if getattr(args, option) and importlib.util.find_spec(module) is None:
            return f"--{option} needs {module}, which is not installed: {install}"
    return None


def api_key(args: argparse.Namespace, environ: dict[str, str] | None = None) -> str | None:
    """The key from --api-key-file, else from $NANOVLLM_API_KEY; None: no key. ValueError (naming
    the file) when the file cannot be read or holds no key."""
    if args.api_key_file:
        text = read_file(args.api_key_file, "--api-key-file").decode()
        keys = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        if not keys:
            raise ValueError(f"--api-key-file: {args.api_key_file!r} holds no key")
        return keys[0]
    return (os.environ if environ is None else environ).get(API_KEY_ENV, "").strip() or None


def call_metadata(args: argparse.Namespace, environ: dict[str, str] | None = None) -> Metadata:
    """What every call sends: the API key, if any, as the server's --api-key-file expects it."""
    key = api_key(args, environ)
    return (("authorization", f"Bearer {key}"),) if key else ()


def open_channel(args: argparse.Namespace) -> grpc.aio.Channel:
    """The channel to the service: TLS when any of --ca-cert, --client-cert, --client-key is given
    (as common.client.GenerationClient), else plaintext. ValueError for a file it cannot read."""
    if args.ca_cert or args.client_cert or args.client_key:
        credentials = channel_credentials(args.ca_cert, args.client_cert, args.client_key)
        return grpc.aio.secure_channel(args.target, credentials, options=channel_options())
    return grpc.aio.insecure_channel(args.target, options=channel_options())


def parse_rates(text: str) -> list[float]:
    return [math.inf if item.strip() == "inf" else float(item) for item in text.split(",") if item.strip()]


def build_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    if args.dataset == "reference":
        prompts, max_tokens = bench_workload(args.num_prompts, args.max_input_len, args.max_output_len)
    else:
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(vocab_size) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
        max_tokens = [args.output_len] * args.num_prompts
    # The reference ids lie below 10001: folded into small vocabularies (tiny test models).
    return [([t % vocab_size for t in p], m) for p, m in zip(prompts, max_tokens, strict=True)]


def arrival_offsets(num: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: a Poisson process of the given rate, or all at 0."""
    if math.isinf(rate):
        return [0.0] * num
    rng, offsets, now = random.Random(seed), [], 0.0
    for _ in range(num):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


class Client:
    """Streams requests and times each delta; counts requests in flight."""

    def __init__(self, stub: generate_pb2_grpc.TextGenerationStub, temperature: float,
                 metadata: Metadata = ()) -> None:
        self.stub = stub
        self.temperature = temperature
        self.metadata = metadata
        self.in_flight = 0
        self.max_in_flight = 0

    async def stream(self, prompt: list[int], max_tokens: int) -> RequestTiming:
        timing = RequestTiming(len(prompt))
        request = build_request(prompt, max_tokens=max_tokens, temperature=self.temperature, ignore_eos=True)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        timing.sent = last = time.perf_counter()
        try:
            async for message in self.stub.GenerateStream(request, metadata=self.metadata):
                now = time.perf_counter()
                num_tokens = len(message.token_ids)
                if not num_tokens:
                    continue
                if timing.first_token is None:
                    timing.first_token = now
                else:
                    timing.inter_token_latencies += [(now - last) / num_tokens] * num_tokens
                last = now
                timing.num_output_tokens += num_tokens
            timing.done = time.perf_counter()
        except grpc.aio.AioRpcError as error:
            timing.error = error.code().name
        finally:
            self.in_flight -= 1
        return timing


async def run_rate(client: Client, workload: Workload, rate: float, max_concurrency: int, seed: int,
                   slo: Slo) -> dict:
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    client.max_in_flight = 0
    start = time.perf_counter()

    async def send(offset: float, prompt: list[int], max_tokens: int) -> RequestTiming:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        if limit is None:
            return await client.stream(prompt, max_tokens)
        async with limit:
            return await client.stream(prompt, max_tokens)

    offsets = arrival_offsets(len(workload), rate, seed)
    timings = await asyncio.gather(*(send(o, p, m) for o, (p, m) in zip(offsets, workload, strict=True)))
    summary = summarize(list(timings), time.perf_counter() - start, slo)
    return {"request_rate": "inf" if math.isinf(rate) else rate, "max_concurrency": max_concurrency or None,
            "max_in_flight": client.max_in_flight, **summary}


async def run_single_stream(client: Client, prompt_len: int, output_len: int, repeats: int, vocab_size: int,
                            seed: int) -> dict:
    """One request at a time, each with a fresh random prompt (no prefix-cache hits)."""
    rng = random.Random(seed + prompt_len)
    timings = [await client.stream([rng.randrange(vocab_size) for _ in range(prompt_len)], output_len)
               for _ in range(repeats)]
    done = [t for t in timings if t.error is None and t.first_token is not None]
    return {"prompt_len": prompt_len, "output_len": output_len, "repeats": repeats, "num_completed": len(done),
            "ttft_ms": distribution_ms([t.ttft for t in done]),
            "itl_ms": distribution_ms([gap for t in done for gap in t.inter_token_latencies])}


async def wait_serving(channel: grpc.aio.Channel, timeout: float) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    while True:
        try:
            reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.aio.AioRpcError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{timeout} s without the service at the target SERVING")
        await asyncio.sleep(1.0)


class ServiceRefused(Exception):
    """The service refused the benchmark's first call (a missing or wrong API key, say)."""


async def run(args: argparse.Namespace) -> dict:
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    metadata = call_metadata(args)
    async with open_channel(args) as channel:
        await wait_serving(channel, args.ready_timeout)  # health needs no key
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        try:
            info = await stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), metadata=metadata, timeout=30)
        except grpc.aio.AioRpcError as error:
            hint = ""
            if error.code() is grpc.StatusCode.UNAUTHENTICATED:
                hint = (" (the key was refused)" if metadata else
                        f" (the service wants an API key: --api-key-file or ${API_KEY_ENV})")
            raise ServiceRefused(f"GetModelInfo: {error.code().name}: {error.details()}{hint}") from None
        client = Client(stub, args.temperature, metadata)
        await asyncio.gather(*(client.stream([1 + i] * 16, 8) for i in range(args.num_warmup)))
        workload = build_workload(args, info.vocab_size)
        runs = []
        for rate in parse_rates(args.request_rates):
            runs.append(await run_rate(client, workload, rate, args.max_concurrency, args.seed, slo))
            print(json.dumps(runs[-1]), flush=True)
        single = []
        for prompt_len in [int(n) for n in args.single_stream_prompt_lens.split(",") if n.strip()]:
            if prompt_len + args.single_stream_output_len > info.max_model_len:
                print(f"single stream: {prompt_len} tokens do not fit max_model_len {info.max_model_len}; skipped")
                continue
            single.append(await run_single_stream(client, prompt_len, args.single_stream_output_len,
                                                  args.single_stream_repeats, info.vocab_size, args.seed))
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": _commit(),
        "target": args.target,
        "model": {"name": info.model_name, "max_model_len": info.max_model_len, "num_kv_blocks": info.num_kv_blocks,
                  "block_size": info.block_size},
        "workload": {"dataset": args.dataset, "num_prompts": args.num_prompts, "temperature": args.temperature,
                     **({"max_input_len": args.max_input_len, "max_output_len": args.max_output_len}
                        if args.dataset == "reference" else {"input_len": args.input_len,
                                                             "output_len": args.output_len})},
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
        "runs": runs,
        "single_stream": single,
    }


def _commit() -> str | None:
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO_ROOT)
    return result.stdout.strip() or None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = check_optional_dependencies(args)
    if problem is not None:
        print(f"bench/serving.py: {problem}", file=sys.stderr)
        return 2
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
    else:
        try:
            results = asyncio.run(run(args))
        except (ValueError, ServiceRefused, TimeoutError) as error:  # a bad option, a refusal: one line
            print(f"bench/serving.py: {error}", file=sys.stderr)
            return 2 if isinstance(error, ValueError) else 1
    print(table(results["runs"], results["single_stream"]))
    if args.json_out and not args.from_json:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    if args.plot:
        title = f"{results['model']['name']} ({results['commit']}): latency against throughput"
        plot(results["runs"], Path(args.plot), title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
