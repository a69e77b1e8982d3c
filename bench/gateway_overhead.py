"""What the Shepherd Model Gateway in front of `nanovllm serve` costs: the same streamed requests
through the gateway (`smg launch`, its OpenAI-compatible HTTP API, the `openai` client) and straight
to our API (nanovllm.generate.v1, GenerationClient.stream), in alternating rounds in one run.

    python bench/gateway_overhead.py                          # the default model on the CPU, 5 rounds
    python bench/gateway_overhead.py --rounds 3 --json-out gateway.json
    python bench/gateway_overhead.py --model PATH --device cuda --concurrency 64

Measured per round and path: one stream of --max-tokens greedy tokens with EOS ignored (first-token
latency from sending to the first non-empty text; decode tokens/s over the tokens after the first),
then --concurrency such streams at once (total output tokens over wall time). The best of the
rounds is reported (the lowest latency, the highest rates) with the ratio gateway/direct. Both
clients run in this process, so the client side (SSE parsing vs protobuf) is part of each path.
Needs the `smg` and `openai` packages (the project's dev extra); every port is a free loopback port.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from common.client import GenerationClient  # noqa: E402
from tests.services_harness import free_port  # noqa: E402

PROMPT = "The history of the city begins"
PATHS = ("direct", "gateway")
# One timed stream: (seconds to the first text, seconds from it to the end, output tokens).
Stream = tuple[float, float, int]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder or .gguf (unset: nanovllm serve's default model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds; the best is reported")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--ready-timeout", type=float, default=600)
    parser.add_argument("--json-out", help="write the arguments, every round and the best here")
    return parser.parse_args(argv)


# The two services.

@contextlib.contextmanager
def serve(args: argparse.Namespace, log: Path) -> Iterator[int]:
    """`nanovllm serve` on a free port, ready; yields the port."""
    port = free_port()
    command = [sys.executable, "-m", "launch.cli", "--log-level", "WARNING", "serve", "--host", "127.0.0.1",
               "--port", str(port), "--device", args.device, *(["--model", args.model] if args.model else [])]
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        with GenerationClient(f"127.0.0.1:{port}") as client:
            client.wait_ready(timeout=args.ready_timeout)
        yield port
    finally:
        _stop(process, grace=30)


@contextlib.contextmanager
def gateway(worker_port: int, log: Path, timeout: float) -> Iterator[tuple[int, str]]:
    """`smg launch` in front of the worker on loopback, once it lists a model on a ready worker;
    yields its port and the model id."""
    port = free_port()
    command = [sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1", "--port", str(port),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               "--worker-urls", f"grpc://127.0.0.1:{worker_port}"]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while (model := _gateway_model(port)) is None:
            if process.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
                raise RuntimeError(f"the gateway did not come up (exit status {process.poll()}):\n{tail}")
            time.sleep(0.2)
        yield port, model
    finally:
        process.kill()  # SIGTERM keeps its listener for a settle window; nothing is left to drain here
        process.wait()


def _gateway_model(port: int) -> str | None:
    """The model the gateway lists once its /workers shows the worker ready, else None."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as response:
            models = [m["id"] for m in json.load(response)["data"]]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/workers", timeout=5) as response:
            workers = json.load(response)["workers"]
    except (OSError, ValueError, KeyError):
        return None
    ready = any(w.get("is_healthy") and w.get("status") == "ready" for w in workers)
    return models[0] if models and ready else None


def _stop(process: subprocess.Popen, grace: float) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# One stream per path.

def direct_stream(client: GenerationClient, args: argparse.Namespace) -> Stream:
    started = time.perf_counter()
    first, num_tokens = None, 0
    for delta in client.stream(args.prompt, max_tokens=args.max_tokens, temperature=0, ignore_eos=True):
        if first is None and delta.text:
            first = time.perf_counter()
        if delta.usage is not None:
            num_tokens = delta.usage.completion_tokens
    return _timed(started, first, num_tokens)


def gateway_stream(client, model: str, args: argparse.Namespace) -> Stream:
    started = time.perf_counter()
    first, num_tokens = None, 0
    chunks = client.completions.create(model=model, prompt=args.prompt, max_tokens=args.max_tokens, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    for chunk in chunks:
        if first is None and any(c.text for c in chunk.choices):
            first = time.perf_counter()
        if chunk.usage is not None:
            num_tokens = chunk.usage.completion_tokens
    return _timed(started, first, num_tokens)


def _timed(started: float, first: float | None, num_tokens: int) -> Stream:
    ended = time.perf_counter()
    if first is None:
        raise RuntimeError("the stream carried no text")
    return first - started, ended - first, num_tokens


# Measures, rounds and the table.

def measure(stream: Callable[[], Stream], args: argparse.Namespace) -> dict:
    """One single stream, then --concurrency at once."""
    ttft_s, decode_s, num_tokens = stream()
    if num_tokens != args.max_tokens:
        raise RuntimeError(f"a stream ran {num_tokens} tokens, not {args.max_tokens}: EOS was not ignored")
    with ThreadPoolExecutor(args.concurrency) as pool:
        started = time.perf_counter()
        streams = list(pool.map(lambda _: stream(), range(args.concurrency)))
        elapsed = time.perf_counter() - started
    return {"ttft_ms": ttft_s * 1e3, "decode_tok_s": (num_tokens - 1) / decode_s,
            "concurrent_tok_s": sum(n for _, _, n in streams) / elapsed,
            "concurrent_tokens": sum(n for _, _, n in streams)}


def best(rounds: list[dict]) -> dict:
    return {"ttft_ms": min(r["ttft_ms"] for r in rounds), "decode_tok_s": max(r["decode_tok_s"] for r in rounds),
            "concurrent_tok_s": max(r["concurrent_tok_s"] for r in rounds)}


def table(args: argparse.Namespace, path_to_best: dict[str, dict]) -> str:
    direct, through = path_to_best["direct"], path_to_best["gateway"]
    rows = [(f"single-stream decode (tok/s), {args.max_tokens} tokens", "decode_tok_s", 1),
            ("single-stream first-token latency (ms)", "ttft_ms", 1),
            (f"{args.concurrency} concurrent streams, total (tok/s)", "concurrent_tok_s", 1)]
    lines = [f"| measure (best of {args.rounds} rounds) | direct | gateway | gateway / direct |",
             "|---|---:|---:|---:|"]
    for name, key, decimals in rows:
        lines.append(f"| {name} | {direct[key]:.{decimals}f} | {through[key]:.{decimals}f} | "
                     f"{through[key] / direct[key]:.3f} |")
    return "\n".join(lines)


def provenance() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except OSError:
        commit = None
    return {"date": datetime.now(UTC).isoformat(timespec="seconds"), "commit": commit,
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "smg": metadata.version("smg"),
            "openai": metadata.version("openai"), "command": " ".join([Path(sys.executable).name, *sys.argv])}


def run(args: argparse.Namespace, logs: Path) -> dict:
    import openai

    path_to_rounds: dict[str, list[dict]] = {path: [] for path in PATHS}
    with serve(args, logs / "serve.log") as port, gateway(port, logs / "smg.log", args.ready_timeout) as (gw, model), \
            GenerationClient(f"127.0.0.1:{port}", timeout=600) as ours, \
            openai.OpenAI(base_url=f"http://127.0.0.1:{gw}/v1", api_key="unused", timeout=600, max_retries=0) as theirs:
        path_to_stream = {"direct": lambda: direct_stream(ours, args),
                          "gateway": lambda: gateway_stream(theirs, model, args)}
        for stream in path_to_stream.values():  # warm-up: connections, the engine's first steps
            stream()
        for index in range(args.rounds):
            order = PATHS if index % 2 == 0 else PATHS[::-1]  # alternate which path goes first
            for path in order:
                path_to_rounds[path].append(measure(path_to_stream[path], args))
                print(f"round {index + 1} {path}: {json.dumps(path_to_rounds[path][-1])}", file=sys.stderr)
    return {"model": model, "rounds": path_to_rounds, "best": {p: best(r) for p, r in path_to_rounds.items()}}


def main() -> int:
    args = parse_args()
    info = provenance()
    with tempfile.TemporaryDirectory(prefix="gateway-overhead-") as logs:
        results = run(args, Path(logs))
    print(f"{results['model']} on {args.device}, prompt {args.prompt!r}; {info['date']}, commit {info['commit']}")
    print(table(args, results["best"]))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "provenance": info, **results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
