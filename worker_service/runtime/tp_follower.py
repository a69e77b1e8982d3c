"""A rank > 0 of a tensor-parallel worker group: a process that loads its shard of the model and
runs, in lockstep with rank 0, every request rank 0 passes on. It serves nothing itself.

It exits when rank 0 says so, when rank 0's process dies (the pipe from it reads end-of-file), or
when a collective fails; rank 0 treats its exit as the loss of the whole group.
"""
from __future__ import annotations

import logging
import os
import threading
from multiprocessing.connection import Connection

import torch

from common.contract.config import WorkerConfig
from common.generated.nanovllm.worker.v1 import worker_pb2
from worker_service import invariant
from worker_service.layers import fused_kernels
from worker_service.loader.placement import resolve_device
from worker_service.parallel import step_channel
from worker_service.parallel.distributed import destroy_tensor_parallel, init_tensor_parallel
from worker_service.parallel.step_channel import MessageKind
from worker_service.runtime.worker import PendingStep, WorkerCore

logger = logging.getLogger(__name__)


def run_follower(rank: int, config: WorkerConfig, init_address: str, from_rank0: Connection, log_level: int,
                 num_threads: int) -> None:
    """The process entry point (spawned by rank 0)."""
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    threading.Thread(target=_exit_when_rank0_dies, args=(from_rank0,), daemon=True, name="rank0-watch").start()
    core = start_rank(config, rank, init_address, num_threads)
    logger.debug("rank %d ready", rank)
    _follow_steps(core)
    core.close()
    destroy_tensor_parallel()


def start_rank(config: WorkerConfig, rank: int, init_address: str, num_threads: int) -> WorkerCore:
    """This process as `rank` of config's group (any rank, 0 included): its share of the host's threads,
    its device, the process group that meets at init_address, and its shard of the model."""
    size = config.tensor_parallel_size
    torch.set_num_threads(num_threads)
    device = resolve_device(config.device, rank, size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_tensor_parallel(rank, size, init_address, device)
    fused_kernels.enable_for(device, config.enforce_eager)  # process-wide: each rank sets it for itself
    if config.deterministic:
        invariant.enable(device)
    return WorkerCore(config)


def _follow_steps(core: WorkerCore) -> None:
    """Runs rank 0's messages until SHUTDOWN. Like rank 0, reads each step back after launching the
    next, so the per-sequence state evolves the same way on every rank."""
    previous: PendingStep | None = None
    while True:
        kind, payload = step_channel.receive()
        if kind == MessageKind.SHUTDOWN:
            return
        try:
            if kind == MessageKind.STEP:
                pending = core.launch(worker_pb2.StepRequest.FromString(payload))
                if previous is not None:
                    previous.result()
                previous = pending
            elif kind == MessageKind.INIT_CACHE:
                previous = None
                core.init_cache(worker_pb2.InitCacheRequest.FromString(payload))
            elif kind == MessageKind.RELEASE:
                core.release(worker_pb2.ReleaseRequest.FromString(payload))
        except ValueError as error:
            # A request that rank 0 rejected too (the state is the same on every rank): rank 0
            # reports it to the scheduler; here it is only skipped.
            logger.debug("rejected as on rank 0: %s", error)


def _exit_when_rank0_dies(from_rank0: Connection) -> None:
    try:
        from_rank0.recv()
    except EOFError:
        pass
    # Rank 0 is gone: this rank may be blocked in a collective that will never complete.
    logger.error("rank 0 exited; leaving the tensor-parallel group")
    os._exit(1)
