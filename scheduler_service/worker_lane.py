"""One worker (or tensor-parallel group) with its own block pool and engine loop. The scheduler
service runs one lane per worker address: data parallelism routes each new request to a lane.

The loop keeps one step in flight ahead (step N+1 is on the wire before step N's tokens return).
A lost worker is reconnected by itself; its unfinished sequences are recomputed from the tokens
the scheduler holds once it answers again, so no request is lost.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from common.config import SchedulerConfig, WorkerInfo
from common.generated.nanovllm.worker.v1 import worker_pb2
from scheduler_service.engine_core import EngineCore, InFlightStep, TokenUpdate
from scheduler_service.metrics import ServiceMetrics
from scheduler_service.sequence import FinishReason, Sequence, SequenceStatus
from scheduler_service.worker_client import WorkerClient

logger = logging.getLogger(__name__)
RECONNECT_DELAY_S = 1.0


@dataclass(frozen=True)
class ModelInfo:
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    block_size: int
    num_kv_blocks: int


def worker_info_from(describe: worker_pb2.DescribeResponse, num_kv_blocks: int) -> WorkerInfo:
    return WorkerInfo(model_name=describe.model_name, dtype=describe.dtype, block_size=describe.block_size,
                      max_model_len=describe.max_model_len, vocab_size=describe.vocab_size,
                      num_kv_blocks=num_kv_blocks, device=describe.device, max_num_seqs=describe.max_num_seqs,
                      max_num_batched_tokens=describe.max_num_batched_tokens)


class WorkerLane:
    def __init__(self, config: SchedulerConfig, worker: WorkerClient, extra_eos_token_ids: set[int],
                 on_updates: Callable[[list[TokenUpdate]], None],
                 on_failure: Callable[[WorkerLane, Exception], None], on_ready: Callable[[], None],
                 metrics: ServiceMetrics | None = None) -> None:
        self.config = config
        self.worker = worker
        self.extra_eos_token_ids = extra_eos_token_ids
        self.on_updates = on_updates
        self.on_failure = on_failure
        self.on_ready = on_ready
        self.metrics = metrics or ServiceMetrics()
        self._was_lost = False  # a worker answered before and then went away
        self.core: EngineCore | None = None
        self.model_info: ModelInfo | None = None
        self.orphans: list[Sequence] = []  # unfinished while no worker is connected
        self.wakeup = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    @property
    def is_ready(self) -> bool:
        return self.core is not None

    @property
    def address(self) -> str:
        return self.worker.address

    @property
    def num_orphans(self) -> int:
        return len(self.orphans)

    @property
    def num_unfinished(self) -> int:
        return self.core.scheduler.num_unfinished if self.core else len(self.orphans)

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name=f"lane-{self.worker.address}")

    def abort(self, seq: Sequence) -> None:
        if self.core is not None:
            self.core.abort(seq)
        else:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = FinishReason.ABORTED
        self.wakeup.set()  # so that the worker is told to release it even when idle

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        await self.worker.close()

    async def _run(self) -> None:
        while True:
            try:
                await self._connect()
                await self._drive()
            except (grpc.aio.AioRpcError, ConnectionError, OSError) as error:
                logger.warning("worker %s lost (%s); its requests will be recomputed once it is back",
                               self.worker.address, error)
                self._on_worker_lost()
                await asyncio.sleep(RECONNECT_DELAY_S)
            except Exception as error:  # a bug: fail the requests in progress rather than hang them
                logger.exception("engine loop of %s failed; failing its requests and starting over",
                                 self.worker.address)
                self.on_failure(self, error)
                self._on_worker_lost()
                self.orphans = []
                await asyncio.sleep(RECONNECT_DELAY_S)

    async def _connect(self) -> None:
        while True:
            try:
                describe = await self.worker.describe()
                break
            except grpc.aio.AioRpcError as error:
                logger.info("waiting for worker %s: %s", self.worker.address, error.code().name)
                await asyncio.sleep(RECONNECT_DELAY_S)
        reply = await self.worker.init_cache(describe.num_kv_blocks)
        info = worker_info_from(describe, reply.num_kv_blocks)
        eos = set(describe.eos_token_ids) | self.extra_eos_token_ids
        core = EngineCore(self.config, info, eos)
        core.adopt([seq for seq in self.orphans if not seq.is_finished])
        self.orphans = []
        self.model_info = ModelInfo(info.model_name, core.max_model_len, info.vocab_size, tuple(sorted(eos)),
                                    info.block_size, info.num_kv_blocks)
        self.core = core
        if self._was_lost:
            self.metrics.counters.worker_recoveries += 1
            self._was_lost = False
        self.on_ready()
        logger.info("worker %s ready: %s, %d KV blocks of %d tokens, max_model_len %d", self.worker.address,
                    info.model_name, info.num_kv_blocks, info.block_size, core.max_model_len)

    def _on_worker_lost(self) -> None:
        if self.core is not None:
            self.orphans = self.core.take_unfinished()
            self._was_lost = True
        self.core = None

    async def _drive(self) -> None:
        core = self.core
        assert core is not None
        in_flight: tuple[InFlightStep, asyncio.Task] | None = None
        # When the last step's result arrived, while steps follow each other with no idle gap: the
        # time to the next result is the engine's step period (GPU time plus unhidden overhead).
        last_result: float | None = None
        while True:
            if in_flight is None and not core.has_unfinished:
                await self._idle(core)
                continue
            step = core.build_step()
            task = asyncio.create_task(self.worker.step(step.request)) if step is not None else None
            if in_flight is not None:
                try:
                    response = await in_flight[1]
                except BaseException:
                    if task is not None:
                        task.cancel()
                    raise
                self.on_updates(core.process_step(in_flight[0], response))
                now = time.perf_counter()
                self.metrics.observe_step(core, None if last_result is None else now - last_result)
                last_result = now if step is not None else None
            elif step is None:
                raise RuntimeError("requests are waiting but none can be scheduled")
            in_flight = (step, task) if step is not None else None

    async def _idle(self, core: EngineCore) -> None:
        released = core.take_released_seq_ids()
        if released:
            await self.worker.release(released)
        self.wakeup.clear()
        if not core.has_unfinished and not core.scheduler.has_released_seq_ids:
            await self.wakeup.wait()
