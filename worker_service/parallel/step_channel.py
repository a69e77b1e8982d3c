"""Rank 0 passes each request that changes worker state (Step, InitCache, Release) to the other
ranks of its tensor-parallel group, which then run it in lockstep with rank 0.

The message is the request's protobuf bytes, broadcast over the host-side gloo group: a header
(kind, length) and then the bytes. Nothing touches the GPU stream, so rank 0 never waits for its
GPU to send a step.
"""
from __future__ import annotations

from enum import IntEnum

import torch
import torch.distributed as dist

from worker_service.parallel.distributed import control_group


class MessageKind(IntEnum):
    STEP = 1
    INIT_CACHE = 2
    RELEASE = 3
    SHUTDOWN = 4


def send(kind: MessageKind, payload: bytes = b"") -> None:
    """On rank 0: broadcasts one message to every other rank."""
    group = control_group()
    dist.broadcast(torch.tensor([int(kind), len(payload)], dtype=torch.int64), src=0, group=group)
    if payload:
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=group)


def receive() -> tuple[MessageKind, bytes]:
    """On the other ranks: waits for rank 0's next message."""
    group = control_group()
    header = torch.empty(2, dtype=torch.int64)
    dist.broadcast(header, src=0, group=group)
    kind, length = (int(value) for value in header.tolist())
    if not length:
        return MessageKind(kind), b""
    payload = torch.empty(length, dtype=torch.uint8)
    dist.broadcast(payload, src=0, group=group)
    return MessageKind(kind), payload.numpy().tobytes()
