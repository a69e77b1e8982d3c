"""A scripted worker (no torch) with a paged KV cache of token ids: a sequence admitted with a prefix
hit reads its first tokens from the blocks another sequence wrote, so a wrong block table or a hit
on blocks not yet written shows as wrong tokens. Its sampling follows SamplingParams: greedy rows
take a function of the history, seeded rows a function of (seed, output index, history), unseeded
rows draw at random; `expected_tokens` computes the same thing for the tests."""
from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

from common.contract.sampling_params import SamplingParams
from common.generated.nanovllm.worker.v1 import worker_pb2


def greedy_token(history: list[int]) -> int:
    return sum(history) * 31 + len(history)


def sampled_token(history: list[int], num_prompt_tokens: int, params: SamplingParams, low: int, vocab_size: int,
                  rng: random.Random) -> int:
    """The scripted model's next token, in [low, vocab_size)."""
    if params.is_greedy:
        value = greedy_token(history)
    elif params.seed is not None:
        output_index = len(history) - num_prompt_tokens
        value = random.Random(f"{params.seed}/{output_index}/{greedy_token(history)}").getrandbits(32)
    else:
        value = rng.getrandbits(32)
    return low + value % (vocab_size - low)


def expected_tokens(prompt: list[int], params: SamplingParams, count: int, low: int, vocab_size: int) -> list[int]:
    """What the worker samples for a seeded or greedy sequence: count tokens after prompt."""
    history = list(prompt)
    for _ in range(count):
        history.append(sampled_token(history, len(prompt), params, low, vocab_size, random.Random()))
    return history[len(prompt):]


@dataclass
class _Held:
    params: SamplingParams
    num_prompt_tokens: int
    num_tokens: int  # tokens the sequence holds once its prefill is computed: it samples from there on
    block_table: list[int]
    history: list[int] = field(default_factory=list)
    num_written: int = 0  # history tokens written into the blocks


class PagedWorker:
    """Speaks the Step protocol; `gate`, when set, holds every step (but the next `steps_before_gate`,
    when that is set) until it is opened."""

    address = "paged"
    uses_tls = False

    def __init__(self, *, vocab_size: int = 100, low: int = 0, eos_token_ids: tuple[int, ...] = (),
                 num_kv_blocks: int = 64, block_size: int = 16, max_model_len: int = 512) -> None:
        self.vocab_size, self.low, self.eos_token_ids = vocab_size, low, eos_token_ids
        self.num_kv_blocks, self.block_size, self.max_model_len = num_kv_blocks, block_size, max_model_len
        self.blocks: dict[int, list[int]] = {}
        self.held: dict[int, _Held] = {}
        self.rng = random.Random()
        self.gate: asyncio.Event | None = None
        self.steps_before_gate: int | None = None
        self.fail_step_ids: set[int] = set()  # answered with a wrong step id, once
        self.seen_seq_ids: list[int] = []  # every sequence sent as new, in order
        self.released_seq_ids: set[int] = set()
        self.num_prompt_tokens_computed = 0  # token ids of new sequences (prompts after their hits)
        self.changed = asyncio.Event()  # set whenever sequences are released

    async def describe(self) -> worker_pb2.DescribeResponse:
        return worker_pb2.DescribeResponse(model_name="paged", block_size=self.block_size,
                                           max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                                           num_kv_blocks=self.num_kv_blocks, eos_token_ids=self.eos_token_ids)

    async def init_cache(self, num_kv_blocks: int) -> worker_pb2.InitCacheResponse:
        self.blocks.clear()
        self.held.clear()
        return worker_pb2.InitCacheResponse(num_kv_blocks=num_kv_blocks)

    async def step(self, request: worker_pb2.StepRequest, timeout_s: float | None = None) -> worker_pb2.StepResponse:
        if self.steps_before_gate:
            self.steps_before_gate -= 1
        elif self.gate is not None:
            await self.gate.wait()
        await asyncio.sleep(0)
        self._release(request.released_seq_ids)
        reply_id = request.step_id + (1000 if request.step_id in self.fail_step_ids else 0)
        self.fail_step_ids.discard(request.step_id)
        response = worker_pb2.StepResponse(step_id=reply_id)
        for new in request.new_sequences:
            self.seen_seq_ids.append(new.seq_id)
            self.num_prompt_tokens_computed += len(new.token_ids)
            held = self.held[new.seq_id] = _Held(SamplingParams.from_proto(new.sampling), new.num_prompt_tokens,
                                                 new.num_tokens, list(new.block_table))
            held.history = [self._read(held, position) for position in range(new.num_computed_tokens)]
            held.num_written = new.num_computed_tokens
            self._compute(new.seq_id, held, list(new.token_ids), 1, response)
        for running in request.running_sequences:
            held = self.held[running.seq_id]
            held.block_table.extend(running.new_block_ids)
            self._compute(running.seq_id, held, list(running.token_ids), max(request.num_decode_steps, 1), response)
        return response

    def _read(self, held: _Held, position: int) -> int:
        return self.blocks[held.block_table[position // self.block_size]][position % self.block_size]

    def _compute(self, seq_id: int, held: _Held, token_ids: list[int], iterations: int,
                 response: worker_pb2.StepResponse) -> None:
        held.history.extend(token_ids)
        if len(held.history) < held.num_tokens:  # a prefill chunk that does not end the prompt
            self._write(held)
            return
        for _ in range(iterations):
            token = sampled_token(held.history, held.num_prompt_tokens, held.params, self.low, self.vocab_size,
                                  self.rng)
            held.history.append(token)
            response.tokens.add(seq_id=seq_id, token_id=token)
        self._write(held)

    def _write(self, held: _Held) -> None:
        """Writes the history into the sequence's blocks as far as they reach."""
        end = min(len(held.history), len(held.block_table) * self.block_size)
        for position in range(held.num_written, end):
            block = self.blocks.setdefault(held.block_table[position // self.block_size], [-1] * self.block_size)
            block[position % self.block_size] = held.history[position]
        held.num_written = max(held.num_written, end)

    def _release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.held.pop(seq_id, None)
            self.released_seq_ids.add(seq_id)
        if seq_ids:
            self.changed.set()

    async def release(self, seq_ids: list[int]) -> None:
        self._release(list(seq_ids))

    async def heartbeat(self, timeout_s: float) -> None:
        await asyncio.sleep(0)

    async def end_session(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def until_released(self, seq_ids: set[int]) -> None:
        """Returns once the scheduler has told the worker to forget every one of seq_ids."""
        while not seq_ids <= self.released_seq_ids:
            self.changed.clear()
            await self.changed.wait()
