"""How loaded the service is, per worker lane: what GetLoad returns and the metrics' gauges show.

Made at the time of asking from the lanes' stats snapshots (nothing is recorded on the hot path).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from scheduler_service.core.outputs import EngineStats


@dataclass(frozen=True)
class LoadReport:
    workers: tuple[tuple[str, EngineStats], ...]  # (address, stats) per lane

    @classmethod
    def of(cls, workers: Iterable[tuple[str, EngineStats]]) -> LoadReport:
        return cls(tuple(workers))

    @property
    def num_running(self) -> int:
        return sum(stats.num_running for _, stats in self.workers)

    @property
    def num_waiting(self) -> int:
        return sum(stats.num_waiting for _, stats in self.workers)

    @property
    def num_workers_ready(self) -> int:
        return sum(stats.is_attached for _, stats in self.workers)

    @property
    def kv_cache_usage(self) -> float:
        """Used blocks / total over the ready workers (0 when none is)."""
        total = sum(stats.num_kv_blocks for _, stats in self.workers)
        return 1.0 - sum(stats.num_free_kv_blocks for _, stats in self.workers) / total if total else 0.0
