"""A fake worker: the worker's gRPC contract (Describe, InitCache, Step, Release; one session at a
time, steps in step_id order) with no model behind it. Every Step is answered at once with
deterministic tokens, so whatever limits throughput in front of it is the scheduler's own CPU.

    python bench/fake_worker.py --port 50061 --model-name /path/with/tokenizer --vocab-size 151936

With a GPU time model (--iteration-ms, --decode-token-us, --prefill-token-us) each reply waits
until a simulated GPU, running the steps one after the other as they arrive, would have finished
it: a step that arrives late leaves that GPU idle, as on a real one. SIGUSR1 writes the simulated
GPU's busy seconds and counts so far to --stats-file (JSON).

It keeps per sequence what the real worker keeps to count samples (tokens held, tokens computed)
and applies the same lookahead rule (common/contract/lookahead.py): a chunk that reaches the end of its
sequence samples one token, a decode samples num_decode_steps. No torch is imported.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.contract.lookahead import num_sampled_tokens  # noqa: E402
from common.generated.nanovllm.worker.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402


def fake_token(seq_id: int, position: int, token_range: int, first_token: int) -> int:
    """The token sampled at position of seq_id: a fixed function, so that runs are repeatable."""
    return first_token + (seq_id * 7919 + position * 104729) % token_range


@dataclass(frozen=True)
class GpuModel:
    """A step's simulated GPU time: per decode iteration a fixed part and a part per sequence,
    plus a part per prompt token. All zero: no GPU time (instant replies)."""

    iteration_s: float = 0.0
    decode_token_s: float = 0.0
    prefill_token_s: float = 0.0

    def step_seconds(self, request: worker_pb2.StepRequest) -> float:
        num_prefill = sum(len(s.token_ids) for s in request.new_sequences)
        num_decoding = 0
        for running in request.running_sequences:
            if running.token_ids:
                num_prefill += len(running.token_ids)
            else:
                num_decoding += 1
        num_iterations = max(request.num_decode_steps, 1)
        return (num_iterations * (self.iteration_s + num_decoding * self.decode_token_s)
                + num_prefill * self.prefill_token_s)


class FakeWorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Answers steps instantly, or when a simulated GPU would have. The shared secret is not
    checked (nothing but the bench reaches it)."""

    def __init__(self, describe: worker_pb2.DescribeResponse, token_range: int, first_token: int = 0,
                 gpu: GpuModel | None = None) -> None:
        self.describe = describe
        self.token_range = token_range
        self.first_token = first_token
        self.gpu = gpu if gpu is not None and gpu != GpuModel() else None
        self._gpu_free_at = 0.0  # loop time when the simulated GPU has run every step so far
        self.gpu_busy_s = 0.0
        # seq_id -> [tokens held, tokens computed], as far as this worker knows.
        self._seq_id_to_counts: dict[int, list[int]] = {}
        self._session_id: str | None = None
        self._next_step_id = 1
        self._turn = asyncio.Condition()
        self.num_steps = 0
        self.num_sampled = 0

    async def Describe(self, request, context):  # noqa: N802 (gRPC method names)
        return self.describe

    async def InitCache(self, request, context):  # noqa: N802
        async with self._turn:
            self._session_id = request.session_id
            self._seq_id_to_counts.clear()
            self._next_step_id = 1
            self._turn.notify_all()
        return worker_pb2.InitCacheResponse(num_kv_blocks=request.num_kv_blocks)

    async def Step(self, request, context):  # noqa: N802
        if request.session_id != self._session_id:
            await context.abort(grpc.StatusCode.ABORTED, "session: not the one holding this worker")
        async with self._turn:  # steps may arrive out of order: each waits for its turn
            await self._turn.wait_for(lambda: self._next_step_id >= request.step_id)
            if request.step_id != self._next_step_id:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"step_id: {request.step_id} out of order")
            self._next_step_id += 1
            response = self._run(request)
            done_at = self._simulate_gpu(request)
            self._turn.notify_all()
        if done_at is not None:
            await asyncio.sleep(done_at - asyncio.get_running_loop().time())
        return response

    def _simulate_gpu(self, request: worker_pb2.StepRequest) -> float | None:
        """When the simulated GPU finishes this step: it starts once the previous one is done (the
        real worker queues a step behind the one running) or now, if the GPU idles."""
        if self.gpu is None:
            return None
        seconds = self.gpu.step_seconds(request)
        self.gpu_busy_s += seconds
        self._gpu_free_at = max(asyncio.get_running_loop().time(), self._gpu_free_at) + seconds
        return self._gpu_free_at

    def stats(self) -> dict[str, float]:
        return {"gpu_busy_s": self.gpu_busy_s, "num_steps": self.num_steps, "num_sampled": self.num_sampled}

    async def Release(self, request, context):  # noqa: N802
        for seq_id in request.seq_ids:
            self._seq_id_to_counts.pop(seq_id, None)
        return worker_pb2.ReleaseResponse()

    def _run(self, request: worker_pb2.StepRequest) -> worker_pb2.StepResponse:
        counts = self._seq_id_to_counts
        for seq_id in request.released_seq_ids:
            counts.pop(seq_id, None)
        num_steps = max(request.num_decode_steps, 1)
        chunks: list[tuple[int, list[int], int]] = []  # (seq_id, counts, tokens computed now)
        for new in request.new_sequences:
            state = counts[new.seq_id] = [new.num_tokens, new.num_computed_tokens]
            chunks.append((new.seq_id, state, len(new.token_ids)))
        for running in request.running_sequences:
            state = counts[running.seq_id]
            if running.token_ids:
                state[0] = max(state[0], state[1] + len(running.token_ids))
                chunks.append((running.seq_id, state, len(running.token_ids)))
            else:
                chunks.append((running.seq_id, state, 1))  # the token it sampled last
        response = worker_pb2.StepResponse(step_id=request.step_id)
        add = response.tokens.add
        token_range, first = self.token_range, self.first_token
        for seq_id, state, num_computed in chunks:
            samples = state[1] + num_computed >= state[0]
            state[1] += num_computed + num_steps - 1
            num_before = state[0]
            state[0] += num_sampled_tokens(state[0], state[1])
            if samples:
                for position in range(num_before, num_before + num_steps):
                    add(seq_id=seq_id, token_id=fake_token(seq_id, position, token_range, first))
                self.num_sampled += num_steps
        self.num_steps += 1
        return response


async def serve(port: int, servicer: FakeWorkerServicer, stats_file: str | None) -> None:
    from common.net.grpc_options import server_options

    server = grpc.aio.server(options=server_options())
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    if stats_file:
        def write_stats() -> None:
            with open(stats_file, "w") as file:
                json.dump(servicer.stats(), file)

        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, write_stats)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"fake worker listening on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-name", required=True, help="what Describe reports (the scheduler loads its "
                                                              "tokenizer from this folder)")
    parser.add_argument("--vocab-size", type=int, default=151936)
    parser.add_argument("--first-token", type=int, default=0, help="sampled tokens lie in [first, first + range)")
    parser.add_argument("--token-range", type=int, default=10000)
    parser.add_argument("--eos-token-id", type=int, action="append", default=[])
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--num-kv-blocks", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--iteration-ms", type=float, default=0.0, help="simulated GPU: per decode iteration")
    parser.add_argument("--decode-token-us", type=float, default=0.0,
                        help="simulated GPU: per decoding sequence per iteration")
    parser.add_argument("--prefill-token-us", type=float, default=0.0, help="simulated GPU: per prompt token")
    parser.add_argument("--stats-file", help="where SIGUSR1 writes the simulated GPU's busy time (JSON)")
    args = parser.parse_args(argv)
    describe = worker_pb2.DescribeResponse(
        model_name=args.model_name, dtype="fake", block_size=args.block_size, max_model_len=args.max_model_len,
        vocab_size=args.vocab_size, num_kv_blocks=args.num_kv_blocks, device="fake", tensor_parallel_size=1,
        eos_token_ids=args.eos_token_id, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens)
    gpu = GpuModel(args.iteration_ms / 1e3, args.decode_token_us / 1e6, args.prefill_token_us / 1e6)
    servicer = FakeWorkerServicer(describe, args.token_range, args.first_token, gpu)
    try:
        asyncio.run(serve(args.port, servicer, args.stats_file))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
