"""One worker (or tensor-parallel group) with its own engine core, block pool and step loop. The
scheduler service runs one lane per worker address: data parallelism routes each new request to a lane,
and the lane is the only way to its core.

The loop keeps one step in flight ahead (step N+1 is on the wire before step N's tokens return).
While the worker is attached, heartbeats watch it apart from the steps (lanes/liveness.py): a worker
that answers none within --worker-liveness-timeout counts as lost. Worker faults are classified
(lanes/worker_faults.py): a lost worker or session is reconnected by itself and its unfinished
sequences are recomputed from the tokens the scheduler holds once it answers again, so no request
is lost, unless none answers within the worker timeout: then they end with UNAVAILABLE. A protocol
error fails only the requests of its step; the others are recomputed on a fresh claim, since the
worker's state can no longer be trusted.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Protocol

import grpc

from common.contract.config import SchedulerConfig
from common.contract.grammar_tokenizer import GrammarTokenizer
from common.contract.sampling_params import SamplingParams
from common.contract.worker_description import WorkerDescription
from common.generated.nanovllm.worker.v1 import worker_pb2
from scheduler_service.core.detokenizer import TokenDecoder
from scheduler_service.core.engine_core import EngineCore
from scheduler_service.core.errors import WorkerLostError, WorkerStepError
from scheduler_service.core.outputs import EngineStats, RequestOutput
from scheduler_service.core.sequence import Sequence, TokenConstraint
from scheduler_service.core.step_builder import InFlightStep
from scheduler_service.core.step_loop import drive
from scheduler_service.lanes.liveness import watch_liveness
from scheduler_service.lanes.step_deadline import StepDeadlines
from scheduler_service.lanes.worker_client import WorkerClient
from scheduler_service.lanes.worker_faults import StepFailedError, WorkerFault, classify
from scheduler_service.lanes.worker_wait import until_answered

logger = logging.getLogger(__name__)
RECONNECT_DELAY_S = 1.0


class LaneOwner(Protocol):
    """Where a lane's results go (the async engine)."""

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """The outputs of one step, one per request that got tokens."""

    def fail(self, lane: WorkerLane, error: Exception, seq_ids: list[int] | None) -> None:
        """Ends those requests of the lane with error (None: all of them)."""

    def lane_ready(self) -> None:
        """A lane's worker (re)connected."""

    async def grammar_tokenizer(self, vocab_size: int, eos_token_ids: frozenset[int]) -> GrammarTokenizer | None:
        """What constraints for this vocabulary compile against, for a worker that advances grammars
        itself; None when requests can carry no constraint."""


class LaneObserver(Protocol):
    """Who watches the lanes (the service's metrics, wired where the service is assembled)."""

    def observe_step(self, lane: str, stats: EngineStats, period_s: float | None) -> None:
        """After each step: the lane's stats and the time since its previous step's result."""

    def count_recovery(self) -> None:
        """A lost worker answered again and its requests are recomputed."""


class WorkerLane:
    def __init__(self, config: SchedulerConfig, worker: WorkerClient, extra_eos_token_ids: Iterable[int],
                 owner: LaneOwner, observer: LaneObserver | None = None) -> None:
        self.config = config
        self.worker = worker
        self.owner = owner
        self.observer = observer
        self.extra_eos_token_ids = tuple(extra_eos_token_ids)  # the tokenizer's, added to each worker's
        self.core = EngineCore(config)
        self._was_lost = False  # a worker answered before and then went away
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._loss_timer: asyncio.TimerHandle | None = None
        self._deadlines = StepDeadlines(config.step_timeout_base_s, config.step_timeout_per_token_s)

    @property
    def is_ready(self) -> bool:
        return self.core.is_attached

    @property
    def address(self) -> str:
        return self.worker.address

    @property
    def served(self) -> WorkerDescription | None:
        """What the lane serves (its last worker's model and limits); None before any connected."""
        return self.core.served

    def stats(self) -> EngineStats:
        return self.core.stats()

    def start(self, extra_eos_token_ids: Iterable[int] | None = None) -> None:
        """Starts the loop; extra_eos_token_ids, when given, replace those the lane was made with
        (known only now: the tokenizer's)."""
        if extra_eos_token_ids is not None:
            self.extra_eos_token_ids = tuple(extra_eos_token_ids)
        self._task = asyncio.create_task(self._run(), name=f"lane-{self.worker.address}")

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, tokenizer: TokenDecoder | None,
                    constraint: Callable[[], TokenConstraint] | None = None) -> Sequence:
        seq = self.core.add_request(prompt_token_ids, params, tokenizer, constraint)
        self._wakeup.set()
        return seq

    def add_samples(self, prompt_token_ids: list[int], params: SamplingParams, tokenizer: TokenDecoder | None,
                    constraint: Callable[[], TokenConstraint] | None = None) -> list[Sequence]:
        """A request of params.n samples: its n sequences, sample 0 first (EngineCore.add_samples)."""
        sequences = self.core.add_samples(prompt_token_ids, params, tokenizer, constraint)
        self._wakeup.set()
        return sequences

    def abort(self, seq: Sequence) -> None:
        """Stops seq now."""
        self.core.abort(seq)
        self._wakeup.set()  # so that the worker is told to release it even when idle

    async def close(self) -> None:
        """Stops the loop and ends the session on the worker, so that the next scheduler claims it at once."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._cancel_loss_timer()
        try:
            await self.worker.end_session()
        except grpc.aio.AioRpcError as error:  # gone already: its lease runs out by itself
            logger.info("worker %s: the session could not be ended (%s); it lapses after the worker's lease",
                        self.worker.address, _describe(error))
        await self.worker.close()

    async def _run(self) -> None:
        while True:
            try:
                await self._connect()
                await self._serve_attached()
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
            self.core.fail_parked()
            self.owner.fail(self, error, None)
            return True
        if fault is WorkerFault.PROTOCOL:  # outside a step (a release): no request to fail
            logger.error("worker %s: %s (%s); its requests will be recomputed", self.worker.address, fault.value,
                         _describe(error))
            return False
        logger.warning("worker %s: %s (%s); its requests will be recomputed once it is back", self.worker.address,
                       fault.value, _describe(error))
        return True

    async def _claim(self) -> tuple[WorkerDescription, int, bool]:
        """Describes the worker and claims it; returns what it serves, the KV blocks it allocated and
        whether it advances grammars itself (it was sent the grammar tokenizer)."""
        describe = WorkerDescription.from_proto(await self.worker.describe())
        grammar_tokenizer = await self._grammar_tokenizer(describe)
        if grammar_tokenizer is None:
            reply = await self.worker.init_cache(describe.num_kv_blocks)
        else:
            reply = await self.worker.init_cache(describe.num_kv_blocks, grammar_tokenizer.to_proto())
        return describe, reply.num_kv_blocks, grammar_tokenizer is not None

    async def _grammar_tokenizer(self, describe: WorkerDescription) -> GrammarTokenizer | None:
        """The grammar tokenizer for a worker that is to advance grammars itself (--grammar-masks worker),
        None for one that takes a mask per step. Only a worker that runs alone (tensor_parallel_size 1)
        does: under tensor parallelism every rank samples in lockstep and would have to advance its own
        matcher with the same tokens, which the ranks do not do; such a lane, and one whose worker reports
        no size, uses the scheduler's masks."""
        if self.config.grammar_masks != "worker" or describe.tensor_parallel_size != 1:
            return None
        # The lane's EOS ids as the core will hold them (attach): constraints compile against those.
        eos_token_ids = frozenset(describe.eos_token_ids) | frozenset(self.extra_eos_token_ids)
        return await self.owner.grammar_tokenizer(describe.vocab_size, eos_token_ids)

    async def _connect(self) -> None:
        describe, num_kv_blocks, grammars_on_worker = await until_answered(self.worker.address, self.worker.uses_tls,
                                                                           self._claim)
        self._cancel_loss_timer()
        served = self.core.attach(describe, num_kv_blocks, self.extra_eos_token_ids, grammars_on_worker)
        if self._was_lost and self.observer is not None:
            self.observer.count_recovery()
        self._was_lost = False
        self.owner.lane_ready()
        logger.info("worker %s ready: %s on %s x%d, %d KV blocks of %d tokens, max_model_len %d%s", self.worker.address,
                    served.model_name, served.device, served.tensor_parallel_size, served.num_kv_blocks,
                    served.block_size, served.max_model_len, ", grammars advanced by the worker" if grammars_on_worker
                    else "")

    def _on_worker_lost(self) -> None:
        if self.core.is_attached:
            self.core.detach()
            self._was_lost = True
        if self._loss_timer is None:
            self._loss_timer = asyncio.get_running_loop().call_later(self.config.worker_timeout_s,
                                                                     self._on_worker_timeout)

    def _on_worker_timeout(self) -> None:
        """No worker came back in time: the parked requests end with UNAVAILABLE."""
        self._loss_timer = None
        parked = self.core.fail_parked()
        if parked:
            logger.error("worker %s lost for %.0f s: failing its %d requests", self.worker.address,
                         self.config.worker_timeout_s, len(parked))
        self.owner.fail(self, WorkerLostError(f"worker lost: none answered within {self.config.worker_timeout_s:g} s"),
                        parked)

    def _cancel_loss_timer(self) -> None:
        if self._loss_timer is not None:
            self._loss_timer.cancel()
            self._loss_timer = None

    def _launch(self, step: InFlightStep, ahead: InFlightStep | None) -> asyncio.Task:
        # The worker finishes the step ahead first: its tokens count towards this step's deadline.
        num_tokens = step.num_tokens + (ahead.num_tokens if ahead is not None else 0)
        return asyncio.create_task(self._timed_step(step, num_tokens))

    async def _timed_step(self, step: InFlightStep, num_tokens: int) -> worker_pb2.StepResponse:
        started = time.perf_counter()
        reply = await self.worker.step(step.request, self._deadlines.timeout_s(num_tokens))
        self._deadlines.observe(num_tokens, time.perf_counter() - started)
        return reply

    def _after_step(self, step: InFlightStep, outputs: list[RequestOutput], period_s: float | None) -> None:
        self.owner.deliver(outputs)
        failed = self.core.take_failed_seq_ids()
        if failed:  # logged by the core, with the token and the grammar's reason
            self.owner.fail(self, WorkerStepError("internal error: the worker sampled a token that the request's "
                                                  "constraint forbids; see the scheduler log"), failed)
        if self.observer is not None:
            self.observer.observe_step(self.worker.address, self.core.stats(), period_s)

    def _on_step_error(self, step: InFlightStep, error: BaseException) -> None:
        if classify(error) is not WorkerFault.PROTOCOL:
            return
        # The step's requests end with INTERNAL, logged once here; the others are recomputed.
        failed = [seq for seq, _ in step.scheduled.values() if not seq.is_finished]
        logger.error("worker %s failed step %d (%s): failing its %d requests, recomputing the others",
                     self.worker.address, step.step_id, _describe(error), len(failed))
        for seq in failed:
            self.core.abort(seq)
        self.owner.fail(self, WorkerStepError("internal error: the worker failed this request's step; see the "
                                              "scheduler log"), [seq.seq_id for seq in failed])
        raise StepFailedError from error

    async def _serve_attached(self) -> None:
        """Drives steps while heartbeats say the worker lives; raises what ended either."""
        driving = asyncio.create_task(self._drive(), name=f"steps-{self.worker.address}")
        watching = asyncio.create_task(watch_liveness(self.worker, self.config.worker_liveness_s),
                                       name=f"liveness-{self.worker.address}")
        try:
            done, _ = await asyncio.wait((driving, watching), return_when=asyncio.FIRST_COMPLETED)
        finally:
            driving.cancel()
            watching.cancel()
            await asyncio.gather(driving, watching, return_exceptions=True)
        done.pop().result()  # neither ends but by raising

    async def _drive(self) -> None:
        core = self.core
        while True:
            await drive(core, self._launch, self._after_step, self._on_step_error)
            released = core.take_released_seq_ids()  # idle: no step comes to carry them
            if released:
                await self.worker.release(released)
            self._wakeup.clear()
            if not core.has_work:
                await self._wakeup.wait()


def _describe(error: BaseException) -> str:
    """A short description of a worker call's failure, for the log."""
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return str(error) or repr(error)
