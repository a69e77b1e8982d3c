"""Out-of-band aborts: the vllm.grpc.engine Abort RPC ends Generate calls by request id.

The engine aborts a request when its outputs' iterator is closed, and an iterator that a call is
awaiting cannot be closed from another task. So Abort cancels the waiting call's task, and only
while that task waits for the engine's next output: the CancelledError surfaces inside the engine's
generator, whose cleanup frees the request's KV blocks at once, and the call takes it back
(Task.uncancel) to end with an "abort" complete. An abort that arrives while the call is sending a
message is noted and takes effect before the next wait; a cancellation from anything else (the
client, the deadline) propagates untouched.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import TypeVar

T = TypeVar("T")


class AbortHandle:
    """One Generate call that Abort may end; made on the call's own task."""

    def __init__(self) -> None:
        self.task = asyncio.current_task()
        self.is_aborted = False
        self._is_waiting = False

    def abort(self) -> None:
        self.is_aborted = True
        if self._is_waiting and self.task is not None:
            self.task.cancel()

    async def iterate(self, items: AsyncIterator[T]) -> AsyncIterator[T]:
        """items until they end or the call is aborted (then is_aborted is set)."""
        while not self.is_aborted:
            self._is_waiting = True
            try:
                item = await anext(items)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                # Ours only if we asked and nothing else did too: uncancel() counts the requests left.
                if not self.is_aborted or self.task is None or self.task.uncancel() > 0:
                    raise
                return
            finally:
                self._is_waiting = False
            yield item


class AbortHandles:
    """The calls in progress by request id (a gateway may reuse an id: every call that holds it ends)."""

    def __init__(self) -> None:
        self._by_request_id: dict[str, list[AbortHandle]] = {}

    @contextlib.contextmanager
    def track(self, request_id: str) -> Iterator[AbortHandle]:
        handle = AbortHandle()
        self._by_request_id.setdefault(request_id, []).append(handle)
        try:
            yield handle
        finally:
            handles = self._by_request_id[request_id]
            handles.remove(handle)
            if not handles:
                del self._by_request_id[request_id]

    def abort(self, request_ids: list[str]) -> int:
        """Aborts every call holding one of request_ids (unknown ids are ignored, as vLLM does);
        returns how many calls it aborted."""
        handles = [h for request_id in request_ids for h in self._by_request_id.get(request_id, ())]
        for handle in handles:
            handle.abort()
        return len(handles)

    def __len__(self) -> int:
        return sum(len(handles) for handles in self._by_request_id.values())
