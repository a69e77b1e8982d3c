"""One worker (or tensor-parallel group) with its own block pool and engine loop. The scheduler
service runs one lane per worker address: data parallelism routes each new request to a lane.

The loop keeps one step in flight ahead (step N+1 is on the wire before step N's tokens return).
Worker faults are classified (scheduler_service/lanes/worker_faults.py): a lost worker or session is
reconnected by itself and its unfinished sequences are recomputed from the tokens the scheduler
holds once it answers again, so no request is lost, unless none answers within the worker
timeout: then they end with UNAVAILABLE. A protocol error fails only the requests of its step;
the others are recomputed on a fresh claim, since the worker's state can no longer be trusted.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Iterable

import grpc

from common.contract.config import SchedulerConfig, WorkerInfo
from common.generated.nanovllm.worker.v1 import worker_pb2
from scheduler_service.core.engine_core import EngineCore, InFlightStep, TokenUpdate, drive
from scheduler_service.core.errors import WorkerLostError, WorkerStepError
from scheduler_service.core.sequence import FinishReason, Sequence
from scheduler_service.lanes.worker_client import WorkerClient
from scheduler_service.lanes.worker_faults import StepFailedError, WorkerFault, classify
from scheduler_service.observe.metrics import ServiceMetrics

logger = logging.getLogger(__name__)
RECONNECT_DELAY_S = 1.0


def engine_core_from(config: SchedulerConfig, describe: worker_pb2.DescribeResponse,
                     init_cache: worker_pb2.InitCacheResponse, extra_eos_token_ids: Iterable[int]) -> EngineCore:
    """The engine of a worker that answered Describe and InitCache: its limits and KV blocks, and its
    EOS ids with extra_eos_token_ids (the tokenizer's)."""
    info = WorkerInfo(model_name=describe.model_name, dtype=describe.dtype, block_size=describe.block_size,
                      max_model_len=describe.max_model_len, vocab_size=describe.vocab_size,
                      num_kv_blocks=init_cache.num_kv_blocks, device=describe.device,
                      max_num_seqs=describe.max_num_seqs, max_num_batched_tokens=describe.max_num_batched_tokens,
                      eos_token_ids=tuple(describe.eos_token_ids))
    return EngineCore(config, info, {*describe.eos_token_ids, *extra_eos_token_ids})


class WorkerLane:
    def __init__(self, config: SchedulerConfig, worker: WorkerClient, extra_eos_token_ids: set[int],
                 on_updates: Callable[[list[TokenUpdate]], None],
                 on_failure: Callable[[WorkerLane, Exception, list[Sequence] | None], None],
                 on_ready: Callable[[], None], metrics: ServiceMetrics | None = None) -> None:
        """on_failure(lane, error, sequences) ends those requests with error (None: all of the lane's)."""
        self.config = config
        self.worker = worker
        self.extra_eos_token_ids = extra_eos_token_ids
        self.on_updates = on_updates
        self.on_failure = on_failure
        self.on_ready = on_ready
        self.metrics = metrics or ServiceMetrics()
        self._was_lost = False  # a worker answered before and then went away
        self.core: EngineCore | None = None
        self.model_info: WorkerInfo | None = None
        self.orphans: list[Sequence] = []  # unfinished while no worker is connected
        self.wakeup = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self._loss_timer: asyncio.TimerHandle | None = None

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
            seq.finish(FinishReason.ABORTED)  # an orphan: no scheduler holds it
        self.wakeup.set()  # so that the worker is told to release it even when idle

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        self._cancel_loss_timer()
        await self.worker.close()

    async def _run(self) -> None:
        while True:
            try:
                await self._connect()
                await self._drive()
            except Exception as error:
                self._on_worker_lost()
                if self._handle_fault(error):
                    await asyncio.sleep(RECONNECT_DELAY_S)

    def _handle_fault(self, error: Exception) -> bool:
        """Logs why the loop stopped (its requests are parked for recompute already) and fails the
        requests it must; True when reconnecting should wait, False to reconnect at once."""
        if isinstance(error, StepFailedError):
            return False  # the step's requests are failed; the rest start over at once
        fault = classify(error)
        if fault is None:  # a bug: fail the requests in progress rather than hang them
            logger.error("engine loop of %s failed; failing its requests and starting over", self.worker.address,
                         exc_info=error)
            self.on_failure(self, error, None)
            self.orphans = []
            return True
        if fault is WorkerFault.PROTOCOL:  # outside a step (a release): no request to fail
            logger.error("worker %s: %s (%s); its requests will be recomputed", self.worker.address, fault.value,
                         _describe(error))
            return False
        logger.warning("worker %s: %s (%s); its requests will be recomputed once it is back", self.worker.address,
                       fault.value, _describe(error))
        return True

    async def _connect(self) -> None:
        last_complaint = None
        while True:
            try:
                describe = await self.worker.describe()
                reply = await self.worker.init_cache(describe.num_kv_blocks)
                break
            except grpc.aio.AioRpcError as error:
                complaint = _describe(error)
                if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    logger.info("waiting for worker %s: %s", self.worker.address, error.code().name)
                elif complaint != last_complaint:  # a refused claim or secret: said once, retried quietly
                    logger.error("worker %s refused us: %s; retrying", self.worker.address, complaint)
                last_complaint = complaint
                await asyncio.sleep(RECONNECT_DELAY_S)
        core = engine_core_from(self.config, describe, reply, self.extra_eos_token_ids)
        info = core.worker_info
        self._cancel_loss_timer()
        core.adopt([seq for seq in self.orphans if not seq.is_finished])
        self.orphans = []
        self.model_info = dataclasses.replace(info, max_model_len=core.max_model_len,
                                              eos_token_ids=tuple(sorted(core.eos_token_ids)))
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
        if self._loss_timer is None:
            self._loss_timer = asyncio.get_running_loop().call_later(self.config.worker_timeout_s,
                                                                     self._on_worker_timeout)

    def _on_worker_timeout(self) -> None:
        """No worker came back in time: the parked requests end with UNAVAILABLE."""
        self._loss_timer = None
        parked = [seq for seq in self.orphans if not seq.is_finished]
        self.orphans = []
        if parked:
            logger.error("worker %s lost for %.0f s: failing its %d requests", self.worker.address,
                         self.config.worker_timeout_s, len(parked))
        for seq in parked:
            seq.finish(FinishReason.ABORTED)
        self.on_failure(self, WorkerLostError(f"worker lost: none answered within {self.config.worker_timeout_s:g} s"),
                        parked)

    def _cancel_loss_timer(self) -> None:
        if self._loss_timer is not None:
            self._loss_timer.cancel()
            self._loss_timer = None

    async def _drive(self) -> None:
        core = self.core
        assert core is not None

        def launch(step: InFlightStep, ahead: InFlightStep | None) -> asyncio.Task:
            # A generous deadline: the base plus per-token time for this step and the one ahead of
            # it, which the worker finishes first.
            num_tokens = step.num_tokens + (ahead.num_tokens if ahead is not None else 0)
            timeout_s = self.config.step_timeout_base_s + self.config.step_timeout_per_token_s * num_tokens
            return asyncio.create_task(self.worker.step(step.request, timeout_s))

        def on_step(step: InFlightStep, updates: list[TokenUpdate], period_s: float | None) -> None:
            self.on_updates(updates)
            self.metrics.observe_step(core, period_s)

        def on_error(step: InFlightStep, error: BaseException) -> None:
            if classify(error) is not WorkerFault.PROTOCOL:
                return
            # The step's requests end with INTERNAL, logged once here; the others are recomputed.
            failed = [seq for seq, _ in step.scheduled.values() if not seq.is_finished]
            logger.error("worker %s failed step %d (%s): failing its %d requests, recomputing the others",
                         self.worker.address, step.step_id, _describe(error), len(failed))
            for seq in failed:
                core.abort(seq)
            self.on_failure(self, WorkerStepError("internal error: the worker failed this request's step; see the "
                                                  "scheduler log"), failed)
            raise StepFailedError from error

        while True:
            await drive(core, launch, on_step, on_error)
            released = core.take_released_seq_ids()  # idle: no step comes to carry them
            if released:
                await self.worker.release(released)
            self.wakeup.clear()
            if not core.has_unfinished and not core.scheduler.has_released_seq_ids:
                await self.wakeup.wait()


def _describe(error: BaseException) -> str:
    """A short description of a worker call's failure, for the log."""
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return repr(error)
