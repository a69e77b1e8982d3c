"""What structured output costs the scheduler, on the default model's vocabulary (49,152 tokens):

- per constrained decode step: the matcher's mask (llguidance) and its TokenMask encoding, by the
  state the grammar is in (one allowed token, a JSON number, free text in a JSON string, a regex
  class), with the form and wire size each gets;
- the Step message of N decodes with and without constraints (build_step_request alone);
- with --lookahead: the price of the lookahead rule (a constrained sequence is not scheduled while
  its last token is pending, and steps run one decode iteration while one is constrained), through the
  AsyncEngine and a simulated worker whose every decode iteration takes --iteration-ms: tokens/s of a
  lone stream, free and constrained, and of 16 free + 16 constrained streams together;
- with --generate: one greedy CPU stream of the default model through the offline LLM, free text
  against a JSON schema with a free string (ms per output token, median of runs).

    python bench/constraint_masks.py [--lookahead] [--generate] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.contract.config import SchedulerConfig  # noqa: E402
from common.contract.constraint import Constraint  # noqa: E402
from common.contract.sampling_params import SamplingParams  # noqa: E402
from common.contract.worker_description import WorkerDescription  # noqa: E402
from common.formats.default_model import default_model_path  # noqa: E402
from common.generated.nanovllm.worker.v1 import worker_pb2  # noqa: E402
from scheduler_service.api.tokenizer import load_tokenizer  # noqa: E402
from scheduler_service.constraints import ConstraintCompiler, allowed_token_ids  # noqa: E402
from scheduler_service.core.engine_core import EngineCore  # noqa: E402
from scheduler_service.core.sequence import Sequence  # noqa: E402

VOCAB_SIZE = 49152
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "bio"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "bio": {"type": "string"}}}
STATES = [  # (what, constraint, output so far)
    ("JSON: the opening '{\"'", Constraint("json_schema", json.dumps(SCHEMA)), ""),
    ("JSON: inside a free string", Constraint("json_schema", json.dumps(SCHEMA)), '{"name":"Al'),
    ("JSON: an integer", Constraint("json_schema", json.dumps(SCHEMA)), '{"name":"Al","age":4'),
    ("regex [a-z ]+", Constraint("regex", "[a-z ]+"), "ab"),
    ("regex [a-m]+", Constraint("regex", "[a-m]+"), "ab"),
    ("choice of 3", Constraint("choice", ("yes", "no", "maybe")), ""),
]


def microseconds(fn, repeats: int = 200) -> float:
    """Median wall time of fn() in µs."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def mask_costs(compiler: ConstraintCompiler, tokenizer) -> None:
    print(f"{'state':32} {'form':16} {'allowed':>8} {'bytes':>6} {'encoded µs':>11} {'cached µs':>10}")
    for what, constraint, prefix in STATES:
        compiled = compiler.compile_now(constraint, VOCAB_SIZE, {tokenizer.eos_token_id})
        seq = Sequence([1, *tokenizer.encode(prefix, add_special_tokens=False)], None, num_prompt_tokens=1)
        state = compiled.new_state()
        state.write_mask(seq, worker_pb2.TokenMask())  # consumes the prefix
        encoded = []
        for _ in range(50):  # the grammar's first mask in this state: listed afresh
            compiled.grammar.masks.clear()
            started = time.perf_counter()
            mask = worker_pb2.TokenMask()
            state.write_mask(seq, mask)
            encoded.append(time.perf_counter() - started)
        # The state met again (by this sequence or another under the same grammar): a copy.
        cached = microseconds(lambda state=state, seq=seq: state.write_mask(seq, worker_pb2.TokenMask()))

        print(f"{what:32} {mask.WhichOneof('form'):16} {len(allowed_token_ids(mask, VOCAB_SIZE)):>8} "
              f"{mask.ByteSize():>6} {statistics.median(encoded) * 1e6:>11.0f} {cached:>10.0f}")


def step_costs(compiler: ConstraintCompiler, tokenizer) -> None:
    """build_step() of N decoding sequences, free and constrained (free text in a JSON string), one
    decode iteration per step for both."""
    info = WorkerDescription(model_name="bench", dtype="bench", block_size=16, max_model_len=4096,
                             vocab_size=VOCAB_SIZE, num_kv_blocks=4096, device="bench",
                             eos_token_ids=(tokenizer.eos_token_id,))
    constraint = Constraint("json_schema", '{"type": "string"}')
    compiled = compiler.compile_now(constraint, VOCAB_SIZE, {tokenizer.eos_token_id})
    quote, letter = (tokenizer.encode(text, add_special_tokens=False)[0] for text in ('"', "a"))
    print(f"\n{'rows':>5} {'free ms/step':>13} {'constrained ms/step':>20} {'per constrained row µs':>23}")
    for rows in (1, 16, 64, 256):
        timings = []
        for constrained in (False, True):
            core = EngineCore(SchedulerConfig(num_decode_steps=1))
            core.attach(info, info.num_kv_blocks)
            params = SamplingParams(max_tokens=2000, ignore_eos=True, constraint=constraint if constrained else None)
            sequences = [core.add_request([7, 8, 9], params, None, compiled.new_state if constrained else None)
                         for _ in range(rows)]
            durations = []
            for index in range(21):  # the prefill's token opens the string; the others are text
                started = time.perf_counter()
                step = core.build_step()
                durations.append(time.perf_counter() - started)
                response = worker_pb2.StepResponse(step_id=step.step_id)
                for seq in sequences:
                    response.tokens.add(seq_id=seq.seq_id, token_id=letter if index else quote)
                core.process_step(step, response)
            durations = durations[1:]
            timings.append(statistics.median(durations) * 1e3)
        print(f"{rows:>5} {timings[0]:>13.3f} {timings[1]:>20.3f} {(timings[1] - timings[0]) / rows * 1e3:>23.0f}")


class SimulatedWorker:
    """The Step protocol with a simulated GPU: each reply comes iteration_s per decode iteration after
    the previous one (steps run one after the other); tokens from the mask when there is one."""

    address = "simulated"
    uses_tls = False

    def __init__(self, eos_token_id: int, iteration_s: float) -> None:
        self.eos_token_id, self.iteration_s = eos_token_id, iteration_s
        self._busy_until = 0.0

    async def describe(self) -> worker_pb2.DescribeResponse:
        return worker_pb2.DescribeResponse(model_name="simulated", block_size=16, max_model_len=4096,
                                           vocab_size=VOCAB_SIZE, num_kv_blocks=4096, eos_token_ids=[self.eos_token_id])

    async def init_cache(self, num_kv_blocks: int) -> worker_pb2.InitCacheResponse:
        return worker_pb2.InitCacheResponse(num_kv_blocks=num_kv_blocks)

    async def step(self, request: worker_pb2.StepRequest, timeout_s: float | None = None) -> worker_pb2.StepResponse:
        import asyncio

        iterations = max(request.num_decode_steps, 1)
        now = time.perf_counter()
        self._busy_until = max(self._busy_until, now) + self.iteration_s * iterations
        response = worker_pb2.StepResponse(step_id=request.step_id)
        for message in (*request.new_sequences, *request.running_sequences):
            for _ in range(iterations):
                token = 1000
                if message.HasField("token_mask"):
                    token = int(allowed_token_ids(message.token_mask, VOCAB_SIZE)[0])
                response.tokens.add(seq_id=message.seq_id, token_id=token)
        await asyncio.sleep(max(self._busy_until - time.perf_counter(), 0))
        return response

    async def release(self, seq_ids: list[int]) -> None:
        pass

    async def heartbeat(self, timeout_s: float) -> None:
        pass

    async def end_session(self) -> None:
        pass

    async def close(self) -> None:
        pass


def lookahead_costs(tokenizer, iteration_ms: float, num_tokens: int = 200) -> None:
    import asyncio

    from scheduler_service.lanes.async_engine import AsyncEngine

    # Never complete within num_tokens: every step samples under the mask.
    constraint = Constraint("regex", f"[a-z]{{{num_tokens * 4}}}")

    async def stream(engine, constrained: bool) -> float:
        params = SamplingParams(max_tokens=num_tokens, ignore_eos=True, constraint=constraint if constrained else None)
        started, count = time.perf_counter(), 0
        async for output in engine.generate([7, 8, 9], params):
            count += len(output.token_ids)
        return count / (time.perf_counter() - started)

    async def scenario(kinds: list[bool]) -> list[float]:
        engine = await AsyncEngine.start(SchedulerConfig(), SimulatedWorker(tokenizer.eos_token_id,
                                                                            iteration_ms / 1e3), tokenizer)
        await engine.wait_ready(5)
        try:
            await stream(engine, True)  # warm-up: the vocabulary and the grammar are built
            return await asyncio.gather(*(stream(engine, kind) for kind in kinds))
        finally:
            await engine.shutdown(0)

    print(f"\nlookahead rule, simulated worker at {iteration_ms} ms per decode iteration (tokens/s per stream)")
    free, constrained = asyncio.run(scenario([False])), asyncio.run(scenario([True]))
    print(f"  one stream alone: free {free[0]:.0f}, constrained {constrained[0]:.0f} "
          f"({constrained[0] / free[0]:.2f} of free)")
    mixed = asyncio.run(scenario([False] * 16 + [True] * 16))
    free_rate, constrained_rate = statistics.mean(mixed[:16]), statistics.mean(mixed[16:])
    print(f"  16 free + 16 constrained: free {free_rate:.0f}, constrained {constrained_rate:.0f} "
          f"({constrained_rate / free_rate:.2f} of free)")


def generate_costs(repeats: int) -> None:
    from offline import LLM

    llm = LLM(default_model_path(), block_size=16, cpu_kv_cache_bytes=1 << 28)
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Describe a cat called Tom as JSON."}])
    story = {"type": "object", "additionalProperties": False, "required": ["story"],
             "properties": {"story": {"type": "string", "minLength": 400}}}  # never closed within max_tokens
    cases = {"free text": SamplingParams(temperature=0, max_tokens=96, ignore_eos=True),
             "json_schema": SamplingParams(temperature=0, max_tokens=96, constraint=Constraint("json_schema",
                                                                                              json.dumps(story)))}
    print(f"\n{'single stream (offline, CPU)':30} {'tokens':>7} {'ms/token':>9}")
    llm.generate(prompt, cases["free text"], use_tqdm=False)  # warm-up
    for name, params in cases.items():
        per_token = []
        for _ in range(repeats):
            started = time.perf_counter()
            result = llm.generate(prompt, params, use_tqdm=False)[0]
            per_token.append((time.perf_counter() - started) / len(result["token_ids"]))
        print(f"{name:30} {len(result['token_ids']):>7} {statistics.median(per_token) * 1e3:>9.1f}")
    llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generate", action="store_true", help="also time a CPU stream of the default model")
    parser.add_argument("--lookahead", action="store_true", help="also time the lookahead rule (simulated worker)")
    parser.add_argument("--iteration-ms", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tokenizer = load_tokenizer(default_model_path())
    compiler = ConstraintCompiler(tokenizer, max_compile_ms=10_000)
    try:
        mask_costs(compiler, tokenizer)
        step_costs(compiler, tokenizer)
    finally:
        compiler.close()
    if args.lookahead:
        lookahead_costs(tokenizer, args.iteration_ms)
    if args.generate:
        generate_costs(args.repeats)


if __name__ == "__main__":
    main()
