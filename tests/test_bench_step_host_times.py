"""bench/step_host_times's timers, on the offline engine with a tiny model on the CPU (the bench itself runs
the reference workload on a GPU): every step's launch and its parts are counted, the methods come back
afterwards, and the table prints what was recorded."""
from __future__ import annotations

import pytest

from bench.step_host_times import TIMED, print_table, timed_methods
from common import SamplingParams
from offline import LLM
from tests.tiny_models import make_tiny_checkpoint
from worker_service.runtime.worker import WorkerCore


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    return LLM(str(make_tiny_checkpoint(tmp_path_factory.mktemp("host-times"), "qwen3")), block_size=16,
               num_kv_blocks=64, num_decode_steps=4)


def test_each_launch_and_its_parts_are_timed_then_the_methods_come_back(llm: LLM) -> None:
    originals = [owner.__dict__[name] for _, owner, name in TIMED]
    launches = []
    original_launch = WorkerCore.launch
    WorkerCore.launch = lambda self, request: launches.append(request) or original_launch(self, request)
    try:
        with timed_methods(TIMED) as times:
            llm.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_tokens=9, ignore_eos=True, temperature=0.5),
                         use_tqdm=False)
    finally:
        WorkerCore.launch = original_launch
    assert len(times["step launch"]) == len(launches) > 1
    # One forward pass, output head and sampling per decode iteration: the prefill's, then four per
    # multi-iteration step for the tokens after the first.
    iterations = sum(max(request.num_decode_steps, 1) for request in launches
                     if request.new_sequences or request.running_sequences)
    assert len(times["  forward passes"]) == len(times["  output head"]) == len(times["  sampling"]) == iterations
    assert times["read-back wait for the GPU"] == []  # on the CPU the read-back has no event to wait for
    assert [owner.__dict__[name] for _, owner, name in TIMED] == originals


def test_the_table_gives_calls_total_median_p90_and_max(capsys) -> None:
    print_table({"step launch": [0.001, 0.003, 0.002], "read-back wait for the GPU": []}, wall_s=1.5)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "wall 1.500 s"
    assert lines[2].split() == ["step", "launch", "3", "6.0", "2000", "2000", "3000"]
    assert lines[3].split() == ["read-back", "wait", "for", "the", "GPU", "0"]
