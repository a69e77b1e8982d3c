"""What rank 0 of a tensor-parallel group does when a request fails on it: the loss of the group when
another rank is gone (its collectives often fail before the watch thread sees the exit), the error
itself otherwise. The group's processes are real; os._exit, which would end the test run, is the
one stand-in."""
from __future__ import annotations

import multiprocessing
import threading
import time

import pytest

from worker_service.parallel.step_channel import MessageKind
from worker_service.runtime import tp_group
from worker_service.runtime.tp_group import TensorParallelCore


class GroupExit(BaseException):
    """Raised where rank 0 would have exited the process."""


def rank_0_with(followers: list[multiprocessing.process.BaseProcess], monkeypatch: pytest.MonkeyPatch) -> object:
    core = object.__new__(TensorParallelCore)  # the failure handling alone: no model, no process group
    core._lock = threading.Lock()
    core._followers = followers
    core._closing = False
    monkeypatch.setattr(tp_group.step_channel, "send", lambda kind, payload=b"": None)

    def exit_(code: int) -> None:
        raise GroupExit(code)

    monkeypatch.setattr(tp_group.os, "_exit", exit_)
    return core


def started(target: object, *args: object) -> multiprocessing.process.BaseProcess:
    process = multiprocessing.get_context("spawn").Process(target=target, args=args, daemon=True)
    process.start()
    return process


def test_a_failure_while_another_rank_is_gone_takes_the_group_down(monkeypatch: pytest.MonkeyPatch) -> None:
    follower = started(time.sleep)  # time.sleep() without an argument fails at once: the rank is gone
    core = rank_0_with([follower], monkeypatch)
    with pytest.raises(GroupExit), core._on_every_rank(MessageKind.STEP, b""):
        raise RuntimeError("Connection closed by peer")


def test_a_failure_with_every_rank_alive_is_the_error(monkeypatch: pytest.MonkeyPatch) -> None:
    follower = started(time.sleep, 3600)
    try:
        core = rank_0_with([follower], monkeypatch)
        monkeypatch.setattr(tp_group, "RANK_EXIT_WAIT_S", 0.2)
        waits = []
        real_wait = tp_group.wait
        monkeypatch.setattr(tp_group, "wait", lambda *args, **kwargs: waits.append(1) or real_wait(*args, **kwargs))
        with pytest.raises(RuntimeError, match="a bug"), core._on_every_rank(MessageKind.STEP, b""):
            raise RuntimeError("a bug")
        assert len(waits) == 1  # an unexpected failure looks for a gone rank first
        with pytest.raises(ValueError, match="rejected"), core._on_every_rank(MessageKind.STEP, b""):
            raise ValueError("rejected on every rank alike")
        assert len(waits) == 1  # a rejected request waits for no rank
    finally:
        follower.kill()
