"""How loaded the service is, per worker lane: what GetLoad returns and the metrics' gauges show.

Read from the lanes' scheduler state at the time of asking (nothing is recorded on the hot path).
The Prometheus scrape reads it from its own thread: it only takes lengths and counts, each read
whole under the GIL, so a report is at worst a step out of date, never inconsistent in a way that
raises.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from scheduler_service.core.engine_core import EngineCore


class Lane(Protocol):
    """What a load report needs of scheduler_service.lanes.worker_lane.WorkerLane."""

    core: EngineCore | None

    @property
    def address(self) -> str: ...

    @property
    def num_orphans(self) -> int: ...


@dataclass(frozen=True)
class WorkerLoad:
    address: str
    is_ready: bool
    num_running: int
    num_waiting: int  # queued for admission; while the worker is lost, every unfinished request
    num_kv_blocks: int
    num_free_kv_blocks: int

    @property
    def kv_cache_usage(self) -> float:
        """Used blocks / total; 0 while the worker is not ready."""
        return 1.0 - self.num_free_kv_blocks / self.num_kv_blocks if self.num_kv_blocks else 0.0


@dataclass(frozen=True)
class LoadReport:
    workers: tuple[WorkerLoad, ...]

    @property
    def num_running(self) -> int:
        return sum(w.num_running for w in self.workers)

    @property
    def num_waiting(self) -> int:
        return sum(w.num_waiting for w in self.workers)

    @property
    def num_workers_ready(self) -> int:
        return sum(w.is_ready for w in self.workers)

    @property
    def kv_cache_usage(self) -> float:
        """Used blocks / total over the ready workers (0 when none is)."""
        total = sum(w.num_kv_blocks for w in self.workers)
        return 1.0 - sum(w.num_free_kv_blocks for w in self.workers) / total if total else 0.0


def worker_load(lane: Lane) -> WorkerLoad:
    core = lane.core  # read once: the lane replaces it when its worker is lost
    if core is None:
        return WorkerLoad(lane.address, False, 0, lane.num_orphans, 0, 0)
    scheduler, blocks = core.scheduler, core.block_manager
    return WorkerLoad(lane.address, True, len(scheduler.running), len(scheduler.waiting), blocks.num_blocks,
                      blocks.num_free_blocks)


def load_report(lanes: Iterable[Lane]) -> LoadReport:
    return LoadReport(tuple(worker_load(lane) for lane in lanes))
