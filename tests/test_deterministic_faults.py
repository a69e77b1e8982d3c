"""Exact through faults (issue 30): with --deterministic, 16 greedy and 16 seeded streams give the same
tokens, and the same logprob bits, when their batches change because of a fault: (a) a worker killed (-9)
mid-stream and replaced, the scheduler recomputing every sequence from the tokens it holds; (b) the
scheduler process killed (-9) mid-stream and a new one taking the worker over (--worker-takeover), the
client resubmitting every cut request (same prompt, same seed).

What makes these tests able to fail: the reference run and the faulted runs batch differently, and each
output token's logprob (float32, as the worker computed it) is compared bit for bit with the token. The
reference runs the 32 requests at most 4 at a time (max_num_seqs=4), each prompt prefilled whole; the
faulted runs take all 32 at once, the prompts (4 to 97 tokens) prefilled in chunks of a 128-token step
budget beside the others' decodes, and the recompute (or the resubmission, under a 64-token budget, in
reverse order) prefills prompt and output tokens again in other chunks and other batches. Measured on
the 2-core CPU machine (2026-12-02) with these tests run without --deterministic: in (a) all 32 streams,
and in (b) all 32 already before the cut, have a different logprob within their first 6 tokens, while
their token ids all agree (a tokens-only version of both tests passed): in float32 this small model's
argmaxes sit too far apart for the last bits to move them (in bfloat16 20 of the 32 streams differ in
their tokens, but --deterministic needs float32 on the CPU), so token ids alone could not tell the flag
from its absence here.
"""
from __future__ import annotations

import random
import signal
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from common.client import GenerationClient, StreamDelta
from common.contract.config import SchedulerConfig
from tests.services_harness import InProcessScheduler, free_port, start_scheduler, start_worker, stop, wait_until
from tests.test_worker_link import health
from tests.tiny_models import make_slow_cpu_checkpoint

NUM_STREAMS = 32  # even indices greedy, odd ones seeded
MAX_TOKENS = 64
# Every stream has this many tokens when the fault comes: all are under way, none is near its end (the
# first prompts are ~20 tokens ahead of the last ones when those start, under the 128-token budget).
NUM_TOKENS_BEFORE_FAULT = 4
# 512 blocks of 16 tokens: room for all 32 sequences at once (they need ~245), so nothing is preempted.
WORKER_FLAGS = ("--deterministic", "--num-kv-blocks", "512")  # float32, the CPU default
REFERENCE_CONFIG = SchedulerConfig(max_num_seqs=4)
FAULTED_BUDGET = "128"  # max_num_batched_tokens of the faulted runs
RESUBMISSION_BUDGET = "64"  # and of the scheduler that takes the worker over
Output = list[tuple[int, float]]  # (token id, logprob) of each output token
WAIT_S = 120  # generous bounds for a loaded 2-core machine; never reached when things work


def requests() -> list[dict[str, Any]]:
    """The 32 requests: distinct random token-id prompts of 4, 7, ..., 97 tokens; greedy and seeded
    (temperatures 0.8 to 1.0, distinct seeds) alternate, so that both kinds span the lengths. Each asks
    for the logprob of its tokens: float32 bits that show any difference in a step's logits."""
    rng = random.Random(30)
    wanted = []
    for index in range(NUM_STREAMS):
        prompt = [rng.randrange(5, 500) for _ in range(4 + 3 * index)]
        sampling = {"temperature": 0.0} if index % 2 == 0 else {"temperature": 0.8 + 0.1 * (index // 2 % 3),
                                                               "seed": 1000 + index}
        wanted.append({"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": True, **sampling})
    return wanted


def kind(index: int) -> str:
    """How request index samples."""
    return "greedy" if index % 2 == 0 else "seeded"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_slow_cpu_checkpoint(tmp_path_factory.mktemp("deterministic"), max_position_embeddings=1024)


def started_worker(model: Path, port: int, *extra: str, **popen) -> subprocess.Popen:
    """A worker with WORKER_FLAGS (and extra) on port, once its health says SERVING (failing at once if
    it exits)."""
    process = start_worker(model, port, *WORKER_FLAGS, *extra, **popen)

    def is_serving() -> bool:
        assert process.poll() is None, f"the worker exited with status {process.returncode}"
        return health(port) == "SERVING"

    wait_until(is_serving, timeout=WAIT_S, what="the worker")
    return process


@pytest.fixture(scope="module")
def reference(model: Path) -> list[Output]:
    """Every request's tokens and logprobs from an undisturbed run, at most 4 sequences a step, prompts
    prefilled whole."""
    port = free_port()
    worker = started_worker(model, port)
    scheduler = InProcessScheduler(model, port, REFERENCE_CONFIG).start()
    try:
        with GenerationClient(scheduler.target, timeout=300) as client:
            client.wait_ready(timeout=WAIT_S)
            with ThreadPoolExecutor(NUM_STREAMS) as pool:
                results = list(pool.map(lambda request: client.generate(**request), requests()))
    finally:
        scheduler.stop()
        stop(worker)
    assert all(len(result.token_ids) == len(result.logprobs) == MAX_TOKENS for result in results)
    return [[(entry.token_id, entry.logprob) for entry in result.logprobs] for result in results]


@dataclass
class StreamRecord:
    """What one stream delivered, read on a thread of its own."""

    outputs: Output = field(default_factory=list)
    finish_reason: str | None = None
    error: grpc.RpcError | None = None
    under_way: threading.Event = field(default_factory=threading.Event)  # NUM_TOKENS_BEFORE_FAULT arrived, or it ended
    ended: threading.Event = field(default_factory=threading.Event)


def read(stream: Iterator[StreamDelta], record: StreamRecord) -> None:
    try:
        for delta in stream:
            record.outputs += [(entry.token_id, entry.logprob) for entry in delta.logprobs]
            record.finish_reason = delta.finish_reason or record.finish_reason
            if len(record.outputs) >= NUM_TOKENS_BEFORE_FAULT:
                record.under_way.set()
    except grpc.RpcError as error:
        record.error = error
    finally:
        record.under_way.set()
        record.ended.set()


def start_streams(client: GenerationClient, pool: ThreadPoolExecutor) -> list[StreamRecord]:
    """All 32 streams at once, each read on its own thread; returns once every one is under way (has
    NUM_TOKENS_BEFORE_FAULT tokens) and none has ended, so a fault now cuts every stream mid-way."""
    records = [StreamRecord() for _ in range(NUM_STREAMS)]
    for request, record in zip(requests(), records, strict=True):
        pool.submit(read, client.stream(**request), record)
    for index, record in enumerate(records):
        assert record.under_way.wait(WAIT_S), f"stream {index} got no token"
    ended = {index: (len(r.outputs), r.error) for index, r in enumerate(records) if r.ended.is_set()}
    assert not ended, f"streams ended before the fault (tokens, error): {ended}"
    return records


def differences(what: str, outputs: list[Output], reference: list[Output],
                num_tokens_before_fault: list[int]) -> list[str]:
    """One line per stream whose outputs are not its reference's: its kind, prompt length, how many of
    its tokens came before the fault, and the first token whose id or logprob differs (a difference below
    that count came from batching alone, one at or above it from the recompute or the resubmission)."""
    lines = []
    for index, (output, expected) in enumerate(zip(outputs, reference, strict=True)):
        if output != expected:
            shorter = min(len(output), len(expected))
            first = next((i for i in range(shorter) if output[i] != expected[i]), shorter)
            if first == shorter:
                found = "no more tokens"
            elif output[first][0] != expected[first][0]:
                found = f"token {output[first][0]} for {expected[first][0]}"
            else:
                found = f"token {output[first][0]}, logprob {output[first][1]!r} for {expected[first][1]!r}"
            lines.append(f"{what}: stream {index} ({kind(index)}, {len(requests()[index]['prompt'])}-token prompt, "
                         f"{num_tokens_before_fault[index]} tokens before the fault): first difference at token "
                         f"{first} of {len(output)}: {found}")
    return lines


def test_streams_are_exact_through_a_killed_worker(model: Path, reference: list[Output]) -> None:
    """kill -9 of the worker while all 32 streams run; a new worker (--deterministic too) comes up on the
    same port; every stream completes (LENGTH, no error) with exactly its reference's tokens and logprobs,
    although the recompute batched and chunked every sequence differently from the reference (and from
    before the loss). worker_recoveries shows that the recompute did happen."""
    port = free_port()
    worker = started_worker(model, port)
    scheduler = InProcessScheduler(model, port, SchedulerConfig(max_num_batched_tokens=int(FAULTED_BUDGET))).start()
    try:
        with GenerationClient(scheduler.target, timeout=300) as client, ThreadPoolExecutor(NUM_STREAMS) as pool:
            client.wait_ready(timeout=WAIT_S)
            records = start_streams(client, pool)
            worker.send_signal(signal.SIGKILL)
            worker.wait()
            num_tokens_before_fault = [len(r.outputs) for r in records]
            worker = started_worker(model, port)
            for record in records:
                assert record.ended.wait(WAIT_S)
        errors = {index: r.error for index, r in enumerate(records) if r.error is not None}
        assert not errors, f"streams failed: {errors}"
        assert all(r.finish_reason == "length" for r in records)
        assert scheduler.metrics is not None and scheduler.metrics.counters.worker_recoveries >= 1
        mismatches = differences("after the worker's loss", [r.outputs for r in records], reference,
                                 num_tokens_before_fault)
        assert not mismatches, "\n".join(mismatches)
    finally:
        scheduler.stop()
        stop(worker)


def test_resubmitted_streams_are_exact_after_a_scheduler_takeover(model: Path, reference: list[Output]) -> None:
    """kill -9 of a scheduler process while all 32 streams run; every stream ends UNAVAILABLE (the
    client's cue to retry), what it delivered a prefix of its reference; a new scheduler process on the
    same port takes the worker over (--worker-takeover: the worker's 60 s lease would keep it out past
    the 30 s it gets to become ready); the client resubmits every cut request as it was (same prompt,
    same seed), in reverse order, and each answer is exactly its reference's tokens and logprobs. The
    worker's log says it was taken over."""
    worker_port, port = free_port(), free_port()
    worker = started_worker(model, worker_port, "--session-lease", "60", stderr=subprocess.PIPE, text=True)
    worker_output: list[str] = []
    drain = threading.Thread(target=lambda: worker_output.extend(worker.stderr), daemon=True)
    drain.start()
    first = start_scheduler(worker_port, port, "--max-num-batched-tokens", FAULTED_BUDGET)
    second = None
    try:
        with GenerationClient(f"127.0.0.1:{port}", timeout=300) as client:
            client.wait_ready(timeout=WAIT_S)
            with ThreadPoolExecutor(NUM_STREAMS) as pool:
                records = start_streams(client, pool)
                first.send_signal(signal.SIGKILL)
                first.wait()
            codes = {index: r.error.code() if r.error else r.finish_reason for index, r in enumerate(records)}
            assert set(codes.values()) == {grpc.StatusCode.UNAVAILABLE}, codes
            prefixes = [r.outputs for r in records]
            num_tokens_before_fault = [len(prefix) for prefix in prefixes]
            # Reported together with the resubmission's differences, at the end.
            mismatches = differences("before the cut", prefixes, [expected[:len(prefix)] for prefix, expected
                                                                  in zip(prefixes, reference, strict=True)],
                                     num_tokens_before_fault)

            second = start_scheduler(worker_port, port, "--worker-takeover", "--max-num-batched-tokens",
                                     RESUBMISSION_BUDGET)
            client.wait_ready(timeout=30)
            wanted = requests()
            with ThreadPoolExecutor(NUM_STREAMS) as pool:
                results = list(pool.map(lambda index: client.generate(**wanted[index]), reversed(range(NUM_STREAMS))))
            answers = [[(entry.token_id, entry.logprob) for entry in result.logprobs] for result in results]
        mismatches += differences("resubmitted", answers[::-1], reference, num_tokens_before_fault)
        assert not mismatches, "\n".join(mismatches)
    finally:
        for process in (first, second):
            if process is not None:
                stop(process)
        stop(worker)
        drain.join(timeout=15)
    assert any("took the worker over" in line for line in worker_output), "".join(worker_output)
