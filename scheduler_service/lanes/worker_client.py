"""How the scheduler talks to a worker: an async interface and its gRPC implementation.

The gRPC client owns one scheduler session on its worker: a random id, fixed for the client's
life, claimed by init_cache, named by every step, release and heartbeat (which renew its lease on
the worker) and ended by end_session; the shared secret goes with every call. With link.takeover,
the first successful claim replaces whichever session held the worker, even a live one; later claims
never do, so that two schedulers that both lost the worker cannot take it from each other in a loop.
"""
from __future__ import annotations

import secrets
from typing import Protocol

import grpc

from common.contract.config import WorkerLinkConfig
from common.generated.nanovllm.worker.v1 import worker_pb2, worker_pb2_grpc
from common.net.grpc_options import channel_options
from common.security.tls import channel_credentials
from common.security.worker_secret import secret_metadata

RECONNECT_BACKOFF_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
                             ("grpc.max_reconnect_backoff_ms", 1000)]


class WorkerClient(Protocol):
    """One worker (or one tensor-parallel group, through its rank 0)."""

    address: str
    uses_tls: bool

    async def describe(self) -> worker_pb2.DescribeResponse: ...

    async def init_cache(self, num_kv_blocks: int,
                         grammar_tokenizer: worker_pb2.GrammarTokenizer | None = None) -> worker_pb2.InitCacheResponse:
        """Claims the worker for this client's session and allocates its KV cache; with grammar_tokenizer
        the worker will advance the grammars of constrained sequences (called with it only then)."""

    async def step(self, request: worker_pb2.StepRequest, timeout_s: float | None = None) -> worker_pb2.StepResponse:
        """Runs one step; raises (grpc.aio.AioRpcError DEADLINE_EXCEEDED) after timeout_s."""

    async def release(self, seq_ids: list[int]) -> None: ...

    async def heartbeat(self, timeout_s: float) -> None:
        """Renews the session's lease; raises ABORTED when the worker does not hold it."""

    async def end_session(self) -> None:
        """Frees the worker for the next scheduler (no-op unless this client claimed it)."""

    async def close(self) -> None: ...


class GrpcWorkerClient:
    """A worker service reached over gRPC (host:port, or unix:/path); TLS when the link has a CA
    or a certificate."""

    def __init__(self, address: str, link: WorkerLinkConfig, describe_timeout_s: float = 10.0) -> None:
        self.address = address
        self.uses_tls = link.uses_tls
        self.describe_timeout_s = describe_timeout_s
        self.session_id = secrets.token_hex(16)
        self._may_take_over = link.takeover
        self._claimed = False
        self._metadata = secret_metadata(link.secret)
        # While the worker is away the channel retries its connection with growing pauses (gRPC's default
        # grows to minutes): capped at a second, so that a worker that comes back is served within one.
        options = [*channel_options(), *RECONNECT_BACKOFF_OPTIONS]
        if self.uses_tls:
            credentials = channel_credentials(link.tls_ca, link.tls_cert, link.tls_key)
            self._channel = grpc.aio.secure_channel(address, credentials, options=options)
        else:
            self._channel = grpc.aio.insecure_channel(address, options=options)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)

    async def describe(self) -> worker_pb2.DescribeResponse:
        return await self._stub.Describe(worker_pb2.DescribeRequest(), timeout=self.describe_timeout_s,
                                         metadata=self._metadata, wait_for_ready=False)

    async def init_cache(self, num_kv_blocks: int,
                         grammar_tokenizer: worker_pb2.GrammarTokenizer | None = None) -> worker_pb2.InitCacheResponse:
        request = worker_pb2.InitCacheRequest(num_kv_blocks=num_kv_blocks, session_id=self.session_id,
                                              takeover=self._may_take_over, grammar_tokenizer=grammar_tokenizer)
        # Allocating a large cache (and building the grammar tokenizer) can take a while on a busy GPU.
        reply = await self._stub.InitCache(request, timeout=300, metadata=self._metadata)
        self._may_take_over = False
        self._claimed = True
        return reply

    async def step(self, request: worker_pb2.StepRequest, timeout_s: float | None = None) -> worker_pb2.StepResponse:
        request.session_id = self.session_id
        return await self._stub.Step(request, timeout=timeout_s, metadata=self._metadata)

    async def release(self, seq_ids: list[int]) -> None:
        await self._stub.Release(worker_pb2.ReleaseRequest(seq_ids=seq_ids, session_id=self.session_id), timeout=30,
                                 metadata=self._metadata)

    async def heartbeat(self, timeout_s: float) -> None:
        await self._stub.Heartbeat(worker_pb2.HeartbeatRequest(session_id=self.session_id), timeout=timeout_s,
                                   metadata=self._metadata)

    async def end_session(self) -> None:
        if self._claimed:
            self._claimed = False
            await self._stub.EndSession(worker_pb2.EndSessionRequest(session_id=self.session_id), timeout=5,
                                        metadata=self._metadata)

    async def close(self) -> None:
        await self._channel.close()
