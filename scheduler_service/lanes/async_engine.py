"""The scheduler service's engine: requests in, token deltas out, over one worker lane per worker.

Requests enter through generate(), an async iterator of RequestOutput; each new request goes to the
ready lane with the least outstanding work in tokens (scheduler_service/lanes/lane_loads.py; data
parallelism: one block pool per lane). If the caller stops iterating (client cancelled, deadline
passed) the sequence is aborted at once: its blocks return to the pool and the worker is told to
release it. A request of n samples (SamplingParams.n) is n sequences on one lane, whose outputs
interleave in one iterator, each tagged with its sample's index (core/samples.py).

A service that listens before its tokenizer is known (a standalone scheduler whose worker names the
model) creates the engine with AsyncEngine.pending() and calls begin() once the tokenizer is loaded:
until then no lane runs, so it is not ready and new requests get UNAVAILABLE "no worker is ready".
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import Any

from common.contract.config import SchedulerConfig
from common.contract.grammar_tokenizer import GrammarTokenizer
from common.contract.sampling_params import SamplingParams
from common.contract.worker_description import WorkerDescription
from scheduler_service.constraints import ConstraintCompiler
from scheduler_service.core.errors import EngineUnavailableError, RequestError, WorkerLostError, WorkerStepError
from scheduler_service.core.outputs import EngineStats, RequestOutput, merged
from scheduler_service.core.sequence import Sequence, TokenConstraint
from scheduler_service.lanes.lane_loads import Charge, LaneLoads
from scheduler_service.lanes.worker_client import WorkerClient
from scheduler_service.lanes.worker_lane import LaneObserver, WorkerLane

logger = logging.getLogger(__name__)
__all__ = ["AsyncEngine", "RequestOutput"]

# What a request still running when the drain ends gets: UNAVAILABLE, which a gateway retries
# elsewhere (an OK status with finish reason ABORTED would read as a finished answer).
GRACE_ENDED = "the service is shutting down: the drain's grace period ended"
DRAIN_CUT = "the service is shutting down: the drain was cut short"


class _Outbox:
    """A request's outputs (or the exception that ends it) not yet taken by its consumer. Cheaper
    than an asyncio.Queue: the consumer takes everything queued at once, and a put only wakes it
    when it waits."""

    __slots__ = ("items", "_waiter")

    def __init__(self) -> None:
        self.items: list[RequestOutput | Exception] = []
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: RequestOutput | Exception) -> None:
        self.items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def take(self) -> list[RequestOutput | Exception]:
        """Everything queued, in order; waits for the first item."""
        while not self.items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        items, self.items = self.items, []
        return items


@dataclass(slots=True)
class _Request:
    seq: Sequence
    lane: WorkerLane
    outputs: _Outbox
    charge: Charge  # its outstanding work on its lane


def _per_sequence(items: list[RequestOutput | Exception]) -> list[RequestOutput]:
    """The outputs of several sequences taken from one outbox, each sequence's joined into one (in
    the order the sequences first appear); raises the first failure among them as generate() does."""
    seq_id_to_outputs: dict[int, list[RequestOutput]] = {}
    for item in items:
        if isinstance(item, EngineUnavailableError | WorkerStepError):
            raise type(item)(str(item))  # a documented status: UNAVAILABLE, INTERNAL
        if isinstance(item, Exception):
            raise RuntimeError(f"the engine failed: {item!r}") from item
        seq_id_to_outputs.setdefault(item.seq_id, []).append(item)
    return [merged(outputs) for outputs in seq_id_to_outputs.values()]


class AsyncEngine:
    """Created with `await AsyncEngine.start(config, worker_or_workers, tokenizer)`; stopped with
    `await engine.shutdown(grace_seconds)`. An observer (the service's metrics) sees every lane's steps."""

    def __init__(self, config: SchedulerConfig, workers: WorkerClient | SequenceABC[WorkerClient],
                 tokenizer: Any | None, eos_token_ids: set[int] | None = None,
                 observer: LaneObserver | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        workers = [workers] if not isinstance(workers, SequenceABC) else list(workers)
        if not workers:
            raise ValueError("worker: at least one worker address is needed")
        self._ready = asyncio.Event()
        self.lanes = [WorkerLane(config, worker, eos_token_ids or (), self, observer) for worker in workers]
        self.lane_loads = LaneLoads()
        self._requests: dict[int, _Request] = {}
        self._draining = False
        self._begun = False
        self._drain_deadline: float | None = None
        self._drain_end = GRACE_ENDED
        # Compiles structured-output constraints; only with a tokenizer (begin()).
        self.constraints: ConstraintCompiler | None = None

    @classmethod
    async def start(cls, config: SchedulerConfig, workers: WorkerClient | SequenceABC[WorkerClient],
                    tokenizer: Any | None, eos_token_ids: set[int] | None = None,
                    observer: LaneObserver | None = None) -> AsyncEngine:
        engine = cls(config, workers, tokenizer, eos_token_ids, observer)
        engine.begin(tokenizer, eos_token_ids)
        return engine

    @classmethod
    def pending(cls, config: SchedulerConfig, workers: WorkerClient | SequenceABC[WorkerClient],
                observer: LaneObserver | None = None) -> AsyncEngine:
        """An engine whose lanes start with begin(): not ready until then (no worker is contacted)."""
        return cls(config, workers, None, None, observer)

    def begin(self, tokenizer: Any | None, eos_token_ids: set[int] | None = None) -> None:
        """Starts the lanes, with the tokenizer and extra EOS ids known at last. Once only."""
        if self._begun:
            raise RuntimeError("the engine's lanes are started already")
        self._begun = True
        self.tokenizer = tokenizer
        if tokenizer is not None:
            self.constraints = ConstraintCompiler(tokenizer, self.config.max_grammar_compile_ms)
        for lane in self.lanes:
            lane.start(eos_token_ids)

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Returns once some lane has a connected worker."""
        async def until_ready() -> None:
            while not self.ready_lanes:
                self._ready.clear()  # lanes set it whenever one (re)connects
                await self._ready.wait()

        await asyncio.wait_for(until_ready(), timeout)

    @property
    def ready_lanes(self) -> list[WorkerLane]:
        return [lane for lane in self.lanes if lane.is_ready]

    @property
    def is_ready(self) -> bool:
        return bool(self.ready_lanes) and not self._draining

    @property
    def model_info(self) -> WorkerDescription | None:
        """What the service serves: a ready lane's model and limits (else the last known)."""
        lanes = self.ready_lanes or self.lanes
        return next((lane.served for lane in lanes if lane.served is not None), None)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def worker_stats(self) -> list[tuple[str, EngineStats]]:
        """Each lane's address and stats, as of now (GetLoad, the gauges)."""
        return [(lane.address, lane.stats()) for lane in self.lanes]

    def _pick_lane(self) -> WorkerLane:
        if self._draining:
            raise EngineUnavailableError("the service is shutting down")
        lanes = self.ready_lanes
        if not lanes:
            raise EngineUnavailableError("no worker is ready")
        return self.lane_loads.least_loaded(lanes)

    @property
    def has_constraints(self) -> bool:
        """Whether requests may carry a constraint: a tokenizer the grammar library accepts."""
        return self.constraints is not None and self.constraints.is_supported

    @property
    def max_grammar_compile_ms(self) -> int:
        return self.config.max_grammar_compile_ms

    async def _lane_for(self, params: SamplingParams) -> tuple[WorkerLane, Callable[[], TokenConstraint] | None]:
        """The lane for a new request, and its constraint compiled for that lane's model (None: free
        text). A compilation awaits the grammar threads, and lanes may come and go meanwhile: the lane
        is picked again after it, and one of another vocabulary gets its own compilation."""
        lane = self._pick_lane()
        if params.constraint is None:
            return lane, None
        if self.constraints is None:
            raise RequestError("constraint: this model has no tokenizer")
        while True:
            served = lane.served
            compiled = await self.constraints.compile(params.constraint, served.vocab_size,  # type: ignore[union-attr]
                                                      served.eos_token_ids)  # type: ignore[union-attr]
            lane = self._pick_lane()
            if compiled.fits(lane.served.vocab_size, lane.served.eos_token_ids):  # type: ignore[union-attr]
                return lane, compiled.new_state

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Streams a request's outputs. Stopping the iteration early aborts the request at once. With
        params.n > 1 the deltas of its n samples interleave, each tagged with its RequestOutput.index,
        until every sample has finished; stopping early aborts them all, and a failure ends them all."""
        if params.n > 1:
            async with contextlib.aclosing(self._generate_samples(prompt_token_ids, params)) as outputs:
                async for output in outputs:
                    yield output
            return
        lane, constraint = await self._lane_for(params)
        seq = lane.add_request(prompt_token_ids, params, self.tokenizer, constraint)
        num_prompt = len(prompt_token_ids)
        max_model_len = lane.served.max_model_len  # type: ignore[union-attr]  # the lane is ready
        charge = self.lane_loads.admit(lane, num_prompt, min(params.max_tokens, max_model_len - num_prompt))
        request = _Request(seq, lane, _Outbox(), charge)
        self._requests[seq.seq_id] = request
        try:
            while True:
                items = await request.outputs.take()
                for item in items:
                    if isinstance(item, EngineUnavailableError | WorkerStepError):
                        raise type(item)(str(item))  # a documented status: UNAVAILABLE, INTERNAL
                    if isinstance(item, Exception):
                        raise RuntimeError(f"the engine failed: {item!r}") from item
                output = merged(items)  # type: ignore[arg-type]
                yield output
                if output.finished:
                    return
        finally:
            if not seq.is_finished:
                lane.abort(seq)
            self._requests.pop(seq.seq_id, None)
            self.lane_loads.finish(charge)

    async def _generate_samples(self, prompt_token_ids: list[int],
                                params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """generate() for n > 1 samples: all on one lane, where they share the prompt's blocks, one
        outbox for all, each sample charged on the lane as a request of its own."""
        lane, constraint = await self._lane_for(params)
        sequences = lane.add_samples(prompt_token_ids, params, self.tokenizer, constraint)
        num_prompt = len(prompt_token_ids)
        max_model_len = lane.served.max_model_len  # type: ignore[union-attr]  # the lane is ready
        outbox = _Outbox()
        requests = [_Request(seq, lane, outbox, self.lane_loads.admit(
            lane, num_prompt, min(params.max_tokens, max_model_len - num_prompt))) for seq in sequences]
        for request in requests:
            self._requests[request.seq.seq_id] = request
        seq_id_to_index = {seq.seq_id: seq.sample_index for seq in sequences}
        leader, num_unfinished = sequences[0], len(sequences)
        try:
            while num_unfinished:
                for output in _per_sequence(await outbox.take()):
                    output.index = index = seq_id_to_index[output.seq_id]
                    if index:  # the prompt's cached tokens are the request's: those sample 0 found cached
                        output = dataclasses.replace(output, num_cached_tokens=leader.num_cached_tokens)
                    num_unfinished -= output.finished
                    yield output
        finally:
            for request in requests:
                if not request.seq.is_finished:
                    lane.abort(request.seq)
                self._requests.pop(request.seq.seq_id, None)
                self.lane_loads.finish(request.charge)

    async def shutdown(self, grace_s: float = 30.0) -> None:
        """Refuses new requests, lets running ones finish for up to grace_s (or until cut_drain()),
        then ends the rest with UNAVAILABLE (GRACE_ENDED). Requests parked on a lost worker are not
        waited for: nothing runs them."""
        self._draining = True
        loop = asyncio.get_running_loop()
        if self._drain_deadline is None:  # cut_drain() may have come first
            self._drain_deadline = loop.time() + grace_s
        while (any(request.lane.is_ready for request in self._requests.values())
               and loop.time() < self._drain_deadline):
            await asyncio.sleep(0.05)
        for request in list(self._requests.values()):
            request.lane.abort(request.seq)  # its blocks return to the pool, the worker forgets it
            if request.lane.is_ready:
                request.outputs.put(EngineUnavailableError(self._drain_end))
            else:
                request.outputs.put(WorkerLostError("worker lost: the service is shutting down"))
        await asyncio.gather(*(lane.close() for lane in self.lanes))
        if self.constraints is not None:
            self.constraints.close()

    def cut_drain(self) -> None:
        """Ends shutdown()'s wait now (a second signal): what still runs gets UNAVAILABLE (DRAIN_CUT)."""
        self._draining = True
        self._drain_deadline = float("-inf")
        self._drain_end = DRAIN_CUT

    # What the lanes report (LaneOwner).

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """One output per request per step (a step of several decode iterations brings several
        tokens to each: one output)."""
        requests, progress = self._requests, self.lane_loads.progress
        for output in outputs:
            request = requests.get(output.seq_id)
            if request is None:
                continue
            progress(request.charge, len(output.token_ids))
            request.outputs.put(output)

    def fail(self, lane: WorkerLane, error: Exception, seq_ids: list[int] | None) -> None:
        """Ends the lane's requests for seq_ids (all of them when None) with error."""
        wanted = None if seq_ids is None else set(seq_ids)
        for request in list(self._requests.values()):
            if request.lane is lane and (wanted is None or request.seq.seq_id in wanted):
                request.outputs.put(error)

    async def grammar_tokenizer(self, vocab_size: int, eos_token_ids: frozenset[int]) -> GrammarTokenizer | None:
        """The one the lane's constraints compile against (so that its worker builds the same), read off
        the event loop; None without a tokenizer the grammar library can use."""
        if not self.has_constraints:
            return None
        return await asyncio.to_thread(self.constraints.grammar_tokenizer, vocab_size,  # type: ignore[union-attr]
                                       eos_token_ids)

    def lane_ready(self) -> None:
        self._ready.set()
        if self.constraints is not None:  # the grammar library's view of the model, built once, now
            for lane in self.ready_lanes:
                self.constraints.prepare(lane.served.vocab_size, lane.served.eos_token_ids)  # type: ignore[union-attr]
