"""A worker's liveness, watched apart from its steps: a heartbeat every second with a short deadline.

A step's reply may take seconds (a long prefill, a slow CPU), so step deadlines alone would notice a
frozen worker late (they used to after a minute). Heartbeats are answered by the worker's event loop,
never behind model work, so a busy worker answers them at once and only a process that cannot answer
(stopped, hung, unreachable) misses them. Each heartbeat also renews the session's lease on the worker.
"""
from __future__ import annotations

import asyncio
from typing import NoReturn

import grpc

from scheduler_service.lanes.worker_client import WorkerClient
from scheduler_service.lanes.worker_faults import WorkerUnresponsiveError

HEARTBEAT_INTERVAL_S = 1.0


async def watch_liveness(worker: WorkerClient, liveness_s: float) -> NoReturn:
    """Heartbeats worker until a heartbeat fails: raises WorkerUnresponsiveError when none answered
    for liveness_s seconds, else the call's own error. A heartbeat is sent at most `interval` after
    the last answer and gets the rest of liveness_s as its deadline, so a worker that freezes is
    declared lost at most liveness_s later."""
    loop = asyncio.get_running_loop()
    interval = min(HEARTBEAT_INTERVAL_S, liveness_s / 4)
    while True:
        sent = loop.time()
        try:
            await worker.heartbeat(liveness_s - interval)
        except grpc.aio.AioRpcError as error:
            if error.code() is not grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            raise WorkerUnresponsiveError(f"answered no heartbeat for {liveness_s:g} s, the "
                                          "--worker-liveness-timeout") from None
        await asyncio.sleep(max(0.0, interval - (loop.time() - sent)))
