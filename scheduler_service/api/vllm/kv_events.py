"""KV cache events for vllm.grpc.engine SubscribeKvEvents: blocks stored, blocks removed, cache cleared.

Each lane's block manager tells KvEvents of its prefix cache's changes (core.block_manager's
BlockListener); the events of one event-loop turn (about one engine step) go out as one
KvEventBatch to every subscriber, numbered from 1 in the order sent. A gateway routes by prefix
with them: block hashes identify blocks (the scheduler's chained xxh64, as a signed int64) and
token ids let it hash prompts its own way. While no one subscribes, an event costs one test.

Not kept: history. A subscriber hears the changes from its subscription on (start_sequence_number
is not replayed; a gateway sees the gap in the numbers and treats the worker as partially known),
and one that falls MAX_PENDING_BATCHES behind is ended with UNAVAILABLE so that it subscribes again
rather than holding memory. The engine's load is not attached to batches (EngineLoad): the gateway
then keeps polling GetLoads. All lanes report as one rank, as GetServerInfo says.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncGenerator, Iterator

from smg_grpc_proto.generated import common_pb2

from scheduler_service.core.block_manager import StoredBlock
from scheduler_service.core.errors import EngineUnavailableError

MAX_PENDING_BATCHES = 1024
_TWO_63, _TWO_64 = 1 << 63, 1 << 64


def signed_hash(block_hash: int) -> int:
    """The proto's int64 for an unsigned 64-bit hash (two's complement)."""
    return block_hash - _TWO_64 if block_hash >= _TWO_63 else block_hash


class _Subscriber:
    def __init__(self) -> None:
        self.batches: deque[common_pb2.KvEventBatch] = deque()
        self.wakeup = asyncio.Event()
        self.fell_behind = False

    def put(self, batch: common_pb2.KvEventBatch) -> None:
        if len(self.batches) >= MAX_PENDING_BATCHES:
            self.fell_behind = True
        else:
            self.batches.append(batch)
        self.wakeup.set()

    async def batches_until_behind(self) -> AsyncGenerator[common_pb2.KvEventBatch, None]:
        while True:
            await self.wakeup.wait()
            self.wakeup.clear()
            if self.fell_behind:
                raise EngineUnavailableError(f"kv events: this subscriber fell {MAX_PENDING_BATCHES} batches "
                                             "behind; subscribe again")
            while self.batches:
                yield self.batches.popleft()


class KvEvents:
    """The BlockListener of every lane; made and used on the server's event loop."""

    def __init__(self, block_size: int = 0) -> None:
        self.block_size = block_size  # set from the model once a worker is known
        self._subscribers: set[_Subscriber] = set()
        self._pending: list[common_pb2.KvCacheEvent] = []
        self._flush_scheduled = False
        self._next_event_id = 1
        self.sequence_number = 0  # of the last batch sent

    # BlockListener.

    def blocks_stored(self, blocks: list[StoredBlock]) -> None:
        if not self._subscribers:
            return
        run: list[StoredBlock] = []
        for block in blocks:  # one event per chain: a block already cached elsewhere breaks it
            if run and block.parent_hash != run[-1].block_hash:
                self._add_stored(run)
                run = []
            run.append(block)
        self._add_stored(run)

    def blocks_removed(self, hashes: list[int]) -> None:
        if self._subscribers:
            self._add(common_pb2.KvCacheEvent(removed=common_pb2.KvBlocksRemoved(
                block_hashes=[signed_hash(h) for h in hashes])))

    def cache_cleared(self) -> None:
        if self._subscribers:
            self._add(common_pb2.KvCacheEvent(cleared=common_pb2.KvCacheCleared()))

    # Subscribers.

    @contextlib.contextmanager
    def subscription(self) -> Iterator[AsyncGenerator[common_pb2.KvEventBatch, None]]:
        """The batches from entering on, until the caller stops (or falls behind: UNAVAILABLE)."""
        subscriber = _Subscriber()
        self._subscribers.add(subscriber)
        try:
            yield subscriber.batches_until_behind()
        finally:
            self._subscribers.discard(subscriber)

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    def _add_stored(self, run: list[StoredBlock]) -> None:
        self._add(common_pb2.KvCacheEvent(stored=common_pb2.KvBlocksStored(
            parent_block_hash=signed_hash(run[0].parent_hash) if run[0].parent_hash else None,
            blocks=[common_pb2.KvBlock(block_hash=signed_hash(b.block_hash), token_ids=b.token_ids,
                                       block_size=self.block_size) for b in run],
            tier=common_pb2.KV_CACHE_TIER_DEVICE, locality=common_pb2.KV_CACHE_LOCALITY_LOCAL)))

    def _add(self, event: common_pb2.KvCacheEvent) -> None:
        event.event_id = self._next_event_id
        self._next_event_id += 1
        self._pending.append(event)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        events, self._pending = self._pending, []
        if not events or not self._subscribers:
            return
        self.sequence_number += 1
        batch = common_pb2.KvEventBatch(sequence_number=self.sequence_number, timestamp=time.time(), events=events)
        for subscriber in self._subscribers:
            subscriber.put(batch)
