"""What grpc.aio alone charges a server per streamed message: the floor under the scheduler's
GenerateStream, whatever the engine does.

A server process streams prebuilt GenerateStreamResponse messages (4 token ids, as a step of 4
decode iterations brings) on 256 concurrent calls; the client runs in this process. Reported: the
server process's CPU time per message, read from /proc, with each stream sending one message per
event-loop turn (--wait-ms > 0: every stream waits that long between messages, as streams do
between engine steps) or back to back (--wait-ms 0).

    python bench/grpc_stream_floor.py --wait-ms 4
"""
from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.scheduler_capacity import cpu_seconds, free_port  # noqa: E402
from common.generated.nanovllm.generate.v1 import generate_pb2, generate_pb2_grpc  # noqa: E402


class Streamer(generate_pb2_grpc.TextGenerationServicer):
    def __init__(self, num_messages: int, wait_s: float) -> None:
        self.num_messages = num_messages
        self.wait_s = wait_s

    async def GenerateStream(self, request, context):  # noqa: N802 (gRPC method name)
        message = generate_pb2.GenerateStreamResponse(request_id="r", token_ids=[1, 2, 3, 4])
        for _ in range(self.num_messages):
            if self.wait_s:
                await asyncio.sleep(self.wait_s)
            yield message


async def serve(port: int, num_messages: int, wait_s: float) -> None:
    import grpc

    server = grpc.aio.server()
    generate_pb2_grpc.add_TextGenerationServicer_to_server(Streamer(num_messages, wait_s), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def consume(port: int, num_streams: int) -> int:
    import grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)

        async def one() -> int:
            return sum([1 async for _ in stub.GenerateStream(generate_pb2.GenerateRequest())])

        await one()  # warm-up
        return sum(await asyncio.gather(*(one() for _ in range(num_streams))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-streams", type=int, default=256)
    parser.add_argument("--num-messages", type=int, default=200, help="per stream")
    parser.add_argument("--wait-ms", type=float, default=4.0)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # internal: the server process
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve, args.num_messages, args.wait_ms / 1e3))
        return 0
    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--num-messages",
                               str(args.num_messages), "--wait-ms", str(args.wait_ms)])
    try:
        time.sleep(2.0)
        before, started = cpu_seconds(server.pid), time.perf_counter()
        num_messages = asyncio.run(consume(port, args.num_streams))
        after, elapsed = cpu_seconds(server.pid), time.perf_counter() - started
    finally:
        server.terminate()
        server.wait()
    print(f"{num_messages} messages on {args.num_streams} streams in {elapsed:.2f} s, {args.wait_ms:g} ms between "
          f"messages: server CPU {after - before:.2f} s, {(after - before) / num_messages * 1e6:.1f} us per message")
    return 0


if __name__ == "__main__":
    sys.exit(main())
