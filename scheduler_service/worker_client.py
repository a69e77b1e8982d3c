"""How the scheduler talks to a worker: an async interface and its gRPC implementation."""
from __future__ import annotations

from typing import Protocol

import grpc

from common.generated.nanovllm.worker.v1 import worker_pb2, worker_pb2_grpc
from common.grpc_options import channel_options


class WorkerClient(Protocol):
    """One worker (or one tensor-parallel group, through its rank 0)."""

    address: str

    async def describe(self) -> worker_pb2.DescribeResponse: ...

    async def init_cache(self, num_kv_blocks: int) -> worker_pb2.InitCacheResponse: ...

    async def step(self, request: worker_pb2.StepRequest) -> worker_pb2.StepResponse: ...

    async def release(self, seq_ids: list[int]) -> None: ...

    async def close(self) -> None: ...


class GrpcWorkerClient:
    """A worker service reached over gRPC (host:port, or unix:/path)."""

    def __init__(self, address: str, describe_timeout_s: float = 10.0) -> None:
        self.address = address
        self.describe_timeout_s = describe_timeout_s
        self._channel = grpc.aio.insecure_channel(address, options=channel_options())
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)

    async def describe(self) -> worker_pb2.DescribeResponse:
        return await self._stub.Describe(worker_pb2.DescribeRequest(), timeout=self.describe_timeout_s,
                                         wait_for_ready=False)

    async def init_cache(self, num_kv_blocks: int) -> worker_pb2.InitCacheResponse:
        # Allocating a large cache can take a while on a busy GPU.
        return await self._stub.InitCache(worker_pb2.InitCacheRequest(num_kv_blocks=num_kv_blocks), timeout=300)

    async def step(self, request: worker_pb2.StepRequest) -> worker_pb2.StepResponse:
        return await self._stub.Step(request)

    async def release(self, seq_ids: list[int]) -> None:
        await self._stub.Release(worker_pb2.ReleaseRequest(seq_ids=seq_ids), timeout=30)

    async def close(self) -> None:
        await self._channel.close()
