"""Tensor parallelism on CPUs (gloo): a worker over two processes generates exactly what one
process does, in float32 greedy, through prefix-cache hits, chunked prefill and preemption; the
group goes down as one, and a stream open on it completes once a new group is started on its port;
startup errors are one line."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from common import SamplingParams
from common.client import GenerationClient
from common.contract.config import SchedulerConfig, WorkerConfig
from offline import LLM
from tests.services_harness import InProcessScheduler, free_port, run_cli, start_scheduler, stop, wait_until
from tests.services_harness import cli as start_cli
from tests.test_engine_parity import make_prompts, token_ids
from tests.tiny_models import make_tiny_checkpoint, save_tiny_bpe_tokenizer
from worker_service.runtime.tp_group import check_tensor_parallel

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
# Sharded KV heads; and one KV head replicated on both ranks, tied embeddings and a vocabulary that
# does not divide by 2 (the second rank's rows end in padding).
MODELS = {
    "qwen3-h4-kv2": dict(arch="qwen3", num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64),
    "llama-h8-kv1-tied-v509": dict(arch="llama", num_heads=8, num_kv_heads=1, head_dim=16, hidden_size=96,
                                   tie=True, vocab_size=509),
}
# Few blocks (preemption) and 24-token steps (chunked prefill); the second call hits the prefix cache.
OPTIONS = dict(block_size=16, num_kv_blocks=12, max_num_batched_tokens=24, device="cpu")


def generate_twice(path: Path, prompts: list[list[int]], **options) -> tuple[list[list[int]], LLM]:
    """The first prompt alone, then all (sharing its prefix): the tokens of both calls."""
    with LLM(str(path), **OPTIONS, **options) as llm:
        first = token_ids(llm.generate(prompts[:1], GREEDY, use_tqdm=False))
        return first + token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)), llm


@pytest.mark.parametrize("name", list(MODELS))
def test_two_ranks_generate_as_one(name: str, tmp_path: Path) -> None:
    spec = dict(MODELS[name])
    arch = spec.pop("arch")
    path = make_tiny_checkpoint(tmp_path, arch, seed=len(name), **spec)
    prompts = make_prompts(seed=len(name), vocab_size=spec.get("vocab_size", 512))
    expected, _ = generate_twice(path, prompts)
    tokens, llm = generate_twice(path, prompts, tensor_parallel_size=2)
    assert tokens == expected
    assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.stats().num_prefix_hit_tokens >= 5 * 32
    assert llm.engine.stats().num_free_kv_blocks == OPTIONS["num_kv_blocks"]


def test_batches_that_need_whole_rows_gather_the_logits(tmp_path: Path) -> None:
    """Greedy rows asking for log-probabilities sample from the gathered logits (not from each rank's
    slice): the same tokens as one process, the padding after the second rank's tokens dropped."""
    spec = dict(MODELS["llama-h8-kv1-tied-v509"])
    path = make_tiny_checkpoint(tmp_path, spec.pop("arch"), seed=7, **spec)
    prompts = make_prompts(seed=7, vocab_size=spec["vocab_size"])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    with LLM(str(path), **OPTIONS) as llm:
        expected = token_ids(llm.generate(prompts, params, use_tqdm=False))
    with LLM(str(path), **OPTIONS, tensor_parallel_size=2) as llm:
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tp"), "qwen3", num_heads=4, num_kv_heads=2, head_dim=16,
                                hidden_size=64)
    save_tiny_bpe_tokenizer(path)
    return path


def rank_pids(pid: int) -> list[int]:
    """The processes that the worker at pid spawned as its other ranks (from any of its threads)."""
    children = [int(child) for task in Path(f"/proc/{pid}/task").iterdir() for child in _children(task)]
    return [child for child in children
            if b"from multiprocessing.spawn import spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes()]


def _children(task: Path) -> list[str]:
    """One thread's child pids; none when the thread ended between listing and reading."""
    try:
        return (task / "children").read_text().split()
    except FileNotFoundError:
        return []


def is_running(pid: int) -> bool:
    """False once the process is gone or a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_served_group_is_one_worker_and_goes_down_as_one(model: Path) -> None:
    """Through the CLI: the scheduler sees one worker and gets the tokens of the offline engine;
    killing rank 1 takes rank 0 (and its server) down with a non-zero exit."""
    offline = LLM(str(model), block_size=16, num_kv_blocks=64, device="cpu")
    prompts = ["The quick brown fox", "Ça coûte combien?", "def main():"]
    expected = [r["token_ids"] for r in offline.generate(prompts, GREEDY, use_tqdm=False)]
    worker_port, port = free_port(), free_port()
    worker = start_cli("worker", "--model", str(model), "--port", str(worker_port), "--block-size", "16",
                       "--num-kv-blocks", "64", "--device", "cpu", "--tensor-parallel-size", "2")
    scheduler = start_scheduler(worker_port, port)
    client = GenerationClient(f"127.0.0.1:{port}", timeout=60)
    try:
        client.wait_ready(timeout=120)
        assert client.model_info().max_model_len > 0
        for prompt, tokens in zip(prompts, expected, strict=True):
            assert client.generate(prompt, temperature=0, max_tokens=32, ignore_eos=True).token_ids == tokens
        (rank1,) = rank_pids(worker.pid)
        os.kill(rank1, signal.SIGKILL)
        assert worker.wait(timeout=60) == 1
    finally:
        client.close()
        stop(scheduler)
        stop(worker)


def start_group(model: Path, port: int) -> subprocess.Popen:
    """A TP=2 worker group on port, started as a user starts it."""
    return start_cli("worker", "--model", str(model), "--port", str(port), "--block-size", "16",
                     "--num-kv-blocks", "64", "--device", "cpu", "--tensor-parallel-size", "2")


def test_a_stream_completes_on_a_restarted_group_after_a_rank_dies(model: Path) -> None:
    """A greedy stream is open when rank 1 is killed: the group goes down with the request unfinished,
    the scheduler parks it, and once a new group answers on the same port it recomputes the request
    from its tokens: the stream ends with the tokens and text of an undisturbed run."""
    prompt, max_tokens = "The quick brown fox", 96
    worker_port = free_port()
    group = start_group(model, worker_port)
    scheduler = InProcessScheduler(model, worker_port, SchedulerConfig(worker_timeout_s=120)).start()
    client = GenerationClient(scheduler.target, timeout=120)
    restarted = None
    try:
        client.wait_ready(timeout=120)
        engine = scheduler.engine
        assert engine is not None
        (lane,) = engine.lanes
        undisturbed = client.generate(prompt, temperature=0, max_tokens=max_tokens, ignore_eos=True)
        stream = client.stream(prompt, temperature=0, max_tokens=max_tokens, ignore_eos=True)
        deltas = [next(stream) for _ in range(3)]
        (rank1,) = rank_pids(group.pid)
        os.kill(rank1, signal.SIGKILL)
        assert group.wait(timeout=60) == 1
        # The request was cut short: the scheduler holds it for a worker to come back.
        wait_until(lambda: not lane.is_ready, 30, "the scheduler to see the group gone")
        assert lane.stats().num_waiting == 1 and engine.num_unfinished == 1
        assert sum(len(delta.token_ids) for delta in deltas) < max_tokens
        restarted = start_group(model, worker_port)
        deltas += list(stream)
        assert [token for delta in deltas for token in delta.token_ids] == undisturbed.token_ids
        assert "".join(delta.text for delta in deltas) == undisturbed.text
        assert deltas[-1].finish_reason == "length" and deltas[-1].usage.completion_tokens == max_tokens
        assert scheduler.metrics.counters.worker_recoveries == 1
    finally:
        client.close()
        scheduler.stop()
        stop(group)
        if restarted is not None:
            stop(restarted)


def test_other_ranks_exit_when_rank0_dies(model: Path) -> None:
    worker = start_cli("worker", "--model", str(model), "--port", str(free_port()), "--block-size", "16",
                       "--num-kv-blocks", "16", "--device", "cpu", "--tensor-parallel-size", "2")
    try:
        wait_until(lambda: bool(rank_pids(worker.pid)), 120, "rank 1 to start")
        (rank1,) = rank_pids(worker.pid)
        worker.kill()
        worker.wait()
        wait_until(lambda: not is_running(rank1), 60, "rank 1 to exit")
    finally:
        stop(worker)


def test_startup_error_is_one_line(model: Path) -> None:
    result = run_cli("worker", "--model", str(model), "--tensor-parallel-size", "3")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "nanovllm worker: tensor_parallel_size: 4 attention heads do not divide over 3 ranks"]


@pytest.mark.parametrize(("options", "message"), [
    (dict(tensor_parallel_size=2, device="cuda"), "tensor_parallel_size: 2 ranks need 2 GPUs, 0 visible"),
    (dict(tensor_parallel_size=2, device="cuda:1"), "device: cuda:1 names one GPU"),
])
def test_startup_checks(model: Path, options: dict, message: str) -> None:
    if options.get("device") == "cuda" and torch.cuda.device_count():
        pytest.skip("this machine has GPUs")
    with pytest.raises(ValueError, match=f"^{message}"):
        check_tensor_parallel(WorkerConfig(model=str(model), **options))
