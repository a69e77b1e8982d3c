"""A worker over N ranks (tensor parallelism): this process is rank 0 and serves; it spawns ranks
1..N-1 (tp_follower) and passes every state-changing request on to them before running it.

The group lives and dies as one: if any other rank exits, rank 0 exits at once (its server goes
with it, so the scheduler sees a lost worker and recomputes its requests); if rank 0 dies, the
others see their pipe from it close and exit. A request that fails on rank 0 while another rank is
gone (its collectives see the closed connection, often before the watch thread sees the exit)
takes the group down the same way, rather than answering an error the scheduler would hold
against the step's requests.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import wait

import torch

from common.contract.config import WorkerConfig
from common.generated.nanovllm.worker.v1 import worker_pb2
from common.net.ports import free_port
from worker_service import invariant
from worker_service.invariant import cpu_products
from worker_service.layers import fused_kernels
from worker_service.loader.model_loading import read_model_config
from worker_service.loader.placement import resolve_device
from worker_service.parallel import step_channel
from worker_service.parallel.distributed import destroy_tensor_parallel
from worker_service.parallel.step_channel import MessageKind
from worker_service.runtime.tp_follower import run_follower, start_rank
from worker_service.runtime.worker import PendingStep, WorkerCore

logger = logging.getLogger(__name__)
# After a request failed on rank 0, how long another rank's exit may take to show.
RANK_EXIT_WAIT_S = 5.0


def create_worker_core(config: WorkerConfig) -> WorkerCore | TensorParallelCore:
    """The worker of config: a WorkerCore, or rank 0 of a tensor-parallel group."""
    if config.tensor_parallel_size > 1:
        return TensorParallelCore(config)  # each rank enables the fused kernels (tp_follower.start_rank)
    device = resolve_device(config.device)
    fused_kernels.enable_for(device, config.enforce_eager)
    if config.deterministic:
        invariant.enable(device)
    return WorkerCore(config)


def check_tensor_parallel(config: WorkerConfig) -> None:
    """Raises ValueError (one line) when the model cannot be split over tensor_parallel_size ranks
    on this host: more ranks than visible GPUs, or head, layer or expert counts that do not divide."""
    size = config.tensor_parallel_size
    device = resolve_device(config.device)
    if device.type == "cuda" and size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size: {size} ranks need {size} GPUs, {torch.cuda.device_count()} visible")
    model = read_model_config(config.model)
    if model.num_heads % size:
        raise ValueError(f"tensor_parallel_size: {model.num_heads} attention heads do not divide over {size} ranks")
    if model.num_kv_heads % size and size % model.num_kv_heads:
        raise ValueError(f"tensor_parallel_size: {model.num_kv_heads} KV heads neither divide over {size} ranks "
                         "nor replicate evenly")
    has_dense_layers = not all(model.is_moe_layer(index) for index in range(model.num_layers))
    if has_dense_layers and model.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size: intermediate size {model.intermediate_size} does not divide "
                         f"over {size} ranks")
    if model.num_experts % size:  # experts are split whole (layers.moe)
        raise ValueError(f"tensor_parallel_size: {model.num_experts} experts (num_experts) do not divide over "
                         f"{size} ranks")
    if config.deterministic and device.type == "cpu":
        # The batch-invariant row-parallel product sums whole chunks of inputs (invariant/cpu_products).
        for what, inputs in (("attention heads x head_dim", model.num_heads * model.head_dim),
                             ("intermediate size", model.intermediate_size)):
            if inputs // size % cpu_products.CHUNK:
                raise ValueError(f"tensor_parallel_size: --deterministic needs each rank's share of the {what} "
                                 f"({inputs} / {size}) to be a multiple of {cpu_products.CHUNK}")


class TensorParallelCore:
    """Rank 0 of a group, with WorkerCore's interface: Describe answers locally; InitCache, Step and
    Release go to every rank first, then run here (the collectives inside keep the ranks in step)."""

    def __init__(self, config: WorkerConfig) -> None:
        check_tensor_parallel(config)
        size = config.tensor_parallel_size
        device = resolve_device(config.device, 0, size)
        # Each rank takes an equal share of the cores (on GPUs the host threads matter little).
        num_threads = max(1, torch.get_num_threads() // size) if device.type == "cpu" else torch.get_num_threads()
        address = f"tcp://127.0.0.1:{free_port()}"
        context = multiprocessing.get_context("spawn")
        self._pipes = []  # rank 0 keeps the write ends: its death closes them
        self._followers: list[multiprocessing.process.BaseProcess] = []
        for rank in range(1, size):
            reader, writer = context.Pipe(duplex=False)
            process = context.Process(
                target=run_follower, name=f"nanovllm-tp-rank{rank}",
                args=(rank, config, address, reader, logging.getLogger().getEffectiveLevel(), num_threads))
            process.start()
            reader.close()
            self._pipes.append(writer)
            self._followers.append(process)
        self._closing = False
        threading.Thread(target=self._go_down_when_a_rank_exits, args=(None,), daemon=True, name="tp-watch").start()
        # A process that exits without close() (an exception) would otherwise wait forever at exit
        # for ranks that wait for its next message.
        atexit.register(self._kill_followers)
        try:
            self.core = start_rank(config, 0, address, num_threads)
        except BaseException:
            self._kill_followers()
            destroy_tensor_parallel()
            raise
        # Message order must be execution order: the server calls Release and Step from two threads.
        self._lock = threading.Lock()
        logger.info("tensor-parallel group of %d ranks ready (%s)", size, device.type)

    @property
    def next_step_id(self) -> int:
        return self.core.next_step_id

    def describe(self) -> worker_pb2.DescribeResponse:
        return self.core.describe()

    def init_cache(self, request: worker_pb2.InitCacheRequest) -> worker_pb2.InitCacheResponse:
        with self._on_every_rank(MessageKind.INIT_CACHE, request.SerializeToString()):
            return self.core.init_cache(request)

    def release(self, request: worker_pb2.ReleaseRequest) -> worker_pb2.ReleaseResponse:
        with self._on_every_rank(MessageKind.RELEASE, request.SerializeToString()):
            return self.core.release(request)

    def launch(self, request: worker_pb2.StepRequest) -> PendingStep:
        with self._on_every_rank(MessageKind.STEP, request.SerializeToString()):
            return self.core.launch(request)

    @contextmanager
    def _on_every_rank(self, kind: MessageKind, payload: bytes) -> Iterator[None]:
        """Passes the message to the other ranks, then runs the block (rank 0's part) in message order.
        A failure other than a rejected request (ValueError, raised alike on every rank) while another
        rank is gone or going is the loss of the group."""
        with self._lock:
            try:
                step_channel.send(kind, payload)
                yield
            except ValueError:
                raise
            except Exception:
                self._go_down_when_a_rank_exits(timeout=RANK_EXIT_WAIT_S)
                raise

    def close(self) -> None:
        """Stops the other ranks and leaves the group."""
        if self._closing:
            return
        with self._lock:
            self._closing = True
            step_channel.send(MessageKind.SHUTDOWN)
        self.core.close()
        # NCCL's communicator teardown is collective: every rank leaves the group at the same time,
        # so rank 0 leaves before it waits for the others (waiting first hangs both). A rank that
        # never leaves must not hang this process: the teardown gets a bounded wait.
        leaving = threading.Thread(target=destroy_tensor_parallel, daemon=True, name="tp-leave")
        leaving.start()
        for process in self._followers:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
        leaving.join(timeout=30)
        if leaving.is_alive():
            logger.warning("the tensor-parallel group did not shut down within 30 s; leaving it behind")
        for pipe in self._pipes:
            pipe.close()
        atexit.unregister(self._kill_followers)

    def _kill_followers(self) -> None:
        self._closing = True
        for process in self._followers:
            if process.is_alive():
                process.kill()

    def _go_down_when_a_rank_exits(self, timeout: float | None) -> None:
        """Waits up to timeout seconds (None: for ever) for another rank to exit; if one does, the
        group goes down (_go_down does not return unless the group is closing)."""
        sentinels = {process.sentinel: process for process in self._followers}
        gone = wait(list(sentinels), timeout=timeout)
        if gone:
            process = sentinels[gone[0]]  # type: ignore[index]
            process.join()
            self._go_down(process)

    def _go_down(self, process: multiprocessing.process.BaseProcess) -> None:
        """The whole group exits, process (another rank) being gone. Rank 0 may be blocked in a
        collective that will never complete: it leaves at once, so that the server's socket closes
        and the scheduler recovers the requests elsewhere or later."""
        if self._closing:
            return
        logger.error("tensor-parallel %s exited with code %s; the worker group goes down", process.name,
                     process.exitcode)
        for other in self._followers:
            if other.is_alive():
                other.kill()
        os._exit(1)
