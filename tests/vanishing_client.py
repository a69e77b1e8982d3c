"""A client process for tests/test_vanished_client.py: opens 8 long greedy streams on argv[1] and
prints "streaming" once every one has its first delta; the test then freezes it (SIGSTOP)."""
from __future__ import annotations

import sys
import threading

from common.client import GenerationClient

NUM_STREAMS = 8


def main(target: str, max_tokens: int) -> None:
    client = GenerationClient(target, timeout=600)
    started = threading.Barrier(NUM_STREAMS + 1)

    def run(index: int) -> None:
        stream = client.stream(f"Request {index}: the quick brown fox", temperature=0, max_tokens=max_tokens,
                               ignore_eos=True)
        next(stream)
        started.wait()
        for _ in stream:
            pass

    for index in range(NUM_STREAMS):
        threading.Thread(target=run, args=(index,), daemon=True).start()
    started.wait()
    print("streaming", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
