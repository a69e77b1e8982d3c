"""The scheduler's own capacity: output tok/s of the whole system when the workers cost nothing.

Fake workers (bench/fake_worker.py, one process each) answer every Step at once; the real scheduler
runs as users start it (`python -m launch.cli scheduler --worker A,B`), and the reference workload
(bench/workload.py: 256 requests, EOS ignored) goes through the public gRPC API as in
bench/throughput.py's grpc mode (all requests at once, unary Generate, after a warm-up). What
limits the rate is then the scheduler process (and the client, sharing the machine's cores): the
table also gives the scheduler's CPU time per output token, read from /proc.

    python bench/scheduler_capacity.py                         # 1 and 2 fake workers
    python bench/scheduler_capacity.py --num-workers 2 --profile /tmp/sched.prof
    python bench/scheduler_capacity.py --tokenizer bpe --api stream   # detokenization, stream writes
    python bench/scheduler_capacity.py --iteration-ms 1.8 --decode-token-us 24 --prefill-token-us 1.4

--tokenizer none matches the reference GPU runs (the random checkpoints ship no tokenizer: token
ids only); bpe trains a small byte-level BPE tokenizer (16k tokens, like Qwen's decoder) so that
the scheduler detokenizes every token. --profile writes a cProfile of the scheduler process over
the timed run alone (the scheduler then starts through this script, which enables the profiler
on SIGUSR1 and writes it on SIGUSR2), one file per worker count: FILE.w1, FILE.w2.

With a simulated GPU time per step (bench/fake_worker.py's model: --iteration-ms per decode
iteration, --decode-token-us per decoding sequence and iteration, --prefill-token-us per prompt
token) the workers answer when such a GPU would have finished, so the table shows how much of
the simulated GPU time the scheduler keeps busy ("GPU busy"): what one scheduler process loses to
its own latency with one and with several workers. The last column is the rate the simulated
GPUs would allow if they never idled.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench.workload import bench_workload  # noqa: E402
from common.net.ports import free_port  # noqa: E402
from tests.services_harness import stop  # noqa: E402

SECRET = "scheduler-capacity-bench-secret"
BPE_VOCAB_SIZE = 16384


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", default="1,2", help="comma-separated worker counts, one run each")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--num-decode-steps", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--num-kv-blocks", type=int, default=4096, help="per fake worker")
    parser.add_argument("--iteration-ms", type=float, default=0.0, help="simulated GPU time per decode iteration")
    parser.add_argument("--decode-token-us", type=float, default=0.0,
                        help="simulated GPU time per decoding sequence per iteration")
    parser.add_argument("--prefill-token-us", type=float, default=0.0, help="simulated GPU time per prompt token")
    parser.add_argument("--tokenizer", choices=["none", "bpe"], default="none")
    parser.add_argument("--api", choices=["generate", "stream"], default="generate")
    parser.add_argument("--repeat", type=int, default=1, help="timed runs per worker count (the best is reported)")
    parser.add_argument("--profile", help="cProfile of the scheduler over the timed run: FILE.w<workers>")
    parser.add_argument("--profile-timer", choices=["wall", "cpu"], default="wall",
                        help="cpu: the scheduler thread's CPU clock (for a busy machine; more overhead per call)")
    parser.add_argument("--json-out")
    return parser.parse_args(argv)


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU of a process, all threads (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def make_model_folder(kind: str, folder: Path) -> tuple[int, int]:
    """The folder the fake workers name as their model; returns the range of tokens they sample
    (first, count). Without a tokenizer any id below 10000 will do (the workload's prompt range)."""
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "none":
        return 0, 10000
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    syllables = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "an", "el", "or", "us", "ch", "th", "é", "ß", "ü",
                 "日", "本", "語", "🤖", "→", "0", "1", "7", ",", ".", "\n"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 5))) for _ in range(30000)]
    corpus = [" ".join(rng.choice(words) for _ in range(200)) for _ in range(2000)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB_SIZE, special_tokens=["<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    return 1, tokenizer.get_vocab_size() - 1  # never the special token


def start(command: list[str], **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NANOVLLM_WORKER_SECRET": SECRET}
    return subprocess.Popen(command, cwd=REPO_ROOT, env=env, **popen)


def run_once(args: argparse.Namespace, num_workers: int, model: Path, tokens: tuple[int, int]) -> dict:
    ports = [free_port() for _ in range(num_workers)]
    stats_files = [model.parent / f"worker-{port}.json" for port in ports]
    workers = [start([sys.executable, str(REPO_ROOT / "bench" / "fake_worker.py"), "--port", str(port),
                      "--model-name", str(model), "--first-token", str(tokens[0]), "--token-range", str(tokens[1]),
                      "--vocab-size", str(max(BPE_VOCAB_SIZE, 10001)), "--block-size", str(args.block_size),
                      "--num-kv-blocks", str(args.num_kv_blocks), "--max-num-seqs", str(args.max_num_seqs),
                      "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                      "--iteration-ms", str(args.iteration_ms), "--decode-token-us", str(args.decode_token_us),
                      "--prefill-token-us", str(args.prefill_token_us), "--stats-file", str(stats_file)],
                     stdout=subprocess.DEVNULL)
               for port, stats_file in zip(ports, stats_files, strict=True)]
    public_port = free_port()
    flags = ["--log-level", "WARNING", "scheduler", "--worker", ",".join(f"127.0.0.1:{p}" for p in ports),
             "--port", str(public_port), "--max-num-seqs", str(args.max_num_seqs),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--num-decode-steps", str(args.num_decode_steps)]
    profile = f"{args.profile}.w{num_workers}" if args.profile else None
    if profile:
        scheduler = start([sys.executable, str(Path(__file__).resolve()), "--run-scheduler", profile,
                           args.profile_timer, *flags])
    else:
        scheduler = start([sys.executable, "-m", "launch.cli", *flags])
    try:
        return asyncio.run(_drive(args, f"127.0.0.1:{public_port}", scheduler, workers, stats_files, profile))
    finally:
        stop(scheduler)
        for worker in workers:
            stop(worker)


async def worker_gpu_busy_s(workers: list[subprocess.Popen], stats_files: list[Path]) -> list[float]:
    """Each fake worker's simulated GPU busy time so far."""
    for worker, stats_file in zip(workers, stats_files, strict=True):
        stats_file.unlink(missing_ok=True)
        worker.send_signal(signal.SIGUSR1)
    while not all(stats_file.exists() for stats_file in stats_files):
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # written whole
    return [json.loads(stats_file.read_text())["gpu_busy_s"] for stats_file in stats_files]


async def _drive(args: argparse.Namespace, target: str, scheduler: subprocess.Popen,
                 workers: list[subprocess.Popen], stats_files: list[Path], profile: str | None) -> dict:
    import grpc

    from common.client import GenerationClient, build_request
    from common.generated.nanovllm.generate.v1 import generate_pb2_grpc
    from common.net.grpc_options import channel_options

    with GenerationClient(target) as client:
        client.wait_ready(timeout=120)
    if scheduler.poll() is not None:
        raise RuntimeError(f"the scheduler exited with code {scheduler.returncode}")
    prompts, max_tokens = bench_workload(args.num_seqs, args.max_input_len, args.max_output_len)
    async with grpc.aio.insecure_channel(target, options=channel_options()) as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)

        async def one(request) -> int:
            if args.api == "generate":
                return len((await stub.Generate(request)).token_ids)
            return sum([len(message.token_ids) async for message in stub.GenerateStream(request)])

        await asyncio.gather(*(one(build_request([1] * 100, max_tokens=16, ignore_eos=True)) for _ in range(8)))
        runs = []
        for _ in range(args.repeat):
            requests = [build_request(p, max_tokens=m, temperature=0.6, ignore_eos=True)
                        for p, m in zip(prompts, max_tokens, strict=True)]
            processes = [scheduler, *workers]
            busy_before = await worker_gpu_busy_s(workers, stats_files)
            cpu_before = [cpu_seconds(p.pid) for p in processes]
            if profile:
                scheduler.send_signal(signal.SIGUSR1)
            started = time.perf_counter()
            counts = await asyncio.gather(*(one(r) for r in requests))
            elapsed = time.perf_counter() - started
            if profile:
                scheduler.send_signal(signal.SIGUSR2)
            cpu_after = [cpu_seconds(p.pid) for p in processes]
            busy_after = await worker_gpu_busy_s(workers, stats_files)
            cpu = [None if a is None or b is None else a - b for a, b in zip(cpu_after, cpu_before, strict=True)]
            runs.append({"output_tokens": sum(counts), "seconds": elapsed, "scheduler_cpu_s": cpu[0],
                         "worker_cpu_s": cpu[1:],
                         "gpu_busy_s": [a - b for a, b in zip(busy_after, busy_before, strict=True)]})
        if profile:
            await asyncio.sleep(1.0)  # the scheduler writes the profile
        return min(runs, key=lambda run: run["seconds"])


def run_profiled_scheduler(profile_path: str, timer: str, cli_args: list[str]) -> int:
    """The scheduler as `python -m launch.cli` runs it, profiled between SIGUSR1 and SIGUSR2."""
    import cProfile

    from launch.cli import main

    # The thread's CPU clock leaves out time the process waited for a core (a busy machine).
    profiler = cProfile.Profile(time.thread_time) if timer == "cpu" else cProfile.Profile()

    def enable(signum, frame) -> None:
        profiler.enable()

    def disable(signum, frame) -> None:
        profiler.disable()
        profiler.dump_stats(profile_path)

    signal.signal(signal.SIGUSR1, enable)
    signal.signal(signal.SIGUSR2, disable)
    return main(cli_args)


def report(args: argparse.Namespace, results: dict[int, dict]) -> None:
    simulated = args.iteration_ms or args.decode_token_us or args.prefill_token_us
    gpu = (f"simulated GPU {args.iteration_ms:g} ms/iteration + {args.decode_token_us:g} us/sequence/iteration + "
           f"{args.prefill_token_us:g} us/prompt token" if simulated else "instant replies")
    print()
    print(f"scheduler capacity: {args.num_seqs} requests, fake workers ({gpu}), tokenizer {args.tokenizer}, "
          f"api {args.api}, {args.num_decode_steps} decode steps per step, {os.cpu_count()} CPUs")
    header = f"{'workers':>7} {'out tokens':>10} {'seconds':>8} {'tok/s':>9} {'sched CPU s':>11} {'us/token':>8}"
    print(header + (f" {'GPU busy':>8} {'GPU-bound tok/s':>15}" if simulated else f" {'worker CPU s':>12}"))
    for num_workers, run in results.items():
        cpu = run["scheduler_cpu_s"]
        per_token = f"{cpu / run['output_tokens'] * 1e6:8.1f}" if cpu is not None else f"{'-':>8}"
        line = (f"{num_workers:>7} {run['output_tokens']:>10} {run['seconds']:>8.2f} "
                f"{run['output_tokens'] / run['seconds']:>9.0f} {cpu if cpu is not None else float('nan'):>11.2f} "
                f"{per_token}")
        if simulated:
            busy = run["gpu_busy_s"]
            line += f" {sum(busy) / len(busy) / run['seconds']:>8.2f} {run['output_tokens'] / max(busy):>15.0f}"
        else:
            line += f" {'+'.join(f'{c:.1f}' for c in run['worker_cpu_s'] if c is not None):>12}"
        print(line)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--run-scheduler":  # internal: the profiled scheduler
        return run_profiled_scheduler(argv[1], argv[2], argv[3:])
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="scheduler-capacity-") as folder:
        model = Path(folder) / "fake-model"
        tokens = make_model_folder(args.tokenizer, model)
        results = {n: run_once(args, n, model, tokens) for n in map(int, args.num_workers.split(","))}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    report(args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
