"""Test doubles for the public server: a tiny real tokenizer, a scripted FakeEngine that implements
the AsyncEngine interface, and a thread that serves the public server over a real socket."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from common.contract.sampling_params import SamplingParams
from common.contract.worker_description import WorkerDescription
from scheduler_service.core.errors import EngineUnavailableError, QueueFullError, RequestError
from scheduler_service.core.outputs import EngineStats, RequestOutput
from scheduler_service.core.sequence import FinishReason
from scheduler_service.observe.metrics import ServiceMetrics
from tests.loop_thread import LoopThread, PublicServerThread

WORDS = ["[UNK]", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>",
         "hello", "world", "the", "cat", "sat", "on", "a", "mat"]
EOS_ID = 1
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|> {{ m.content }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def save_tiny_tokenizer(folder: Path, *, with_chat_template: bool = True) -> Path:
    """A whitespace word-level tokenizer saved as a Hugging Face tokenizer folder (tokenizer.json,
    tokenizer_config.json, chat_template.jinja), built with the tokenizers library alone."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken("<|eos|>", special=True)])
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>", "unk_token": "[UNK]"}))
    if with_chat_template:
        (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return folder


def default_script(prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    """ "hello", " world", then EOS: three deltas, logprobs when asked."""
    outputs = []
    for index, (text, token_id) in enumerate([("hello", 6), (" world", 7), ("", EOS_ID)]):
        out = RequestOutput(0, text=text, token_ids=[token_id], num_prompt_tokens=len(prompt))  # as the engine's
        if params.logprobs:
            out.logprobs = [-0.5 * (index + 1)]
            if params.num_top_logprobs:
                out.top_logprobs = [[(token_id, -0.5 * (index + 1)), (8, -3.0)][: params.num_top_logprobs]]
        outputs.append(out)
    last = outputs[-1]
    last.finished, last.finish_reason, last.matched_stop = True, FinishReason.STOP, EOS_ID
    last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens = len(prompt), 3, 2
    return outputs


class FakeEngine:
    """Implements the AsyncEngine interface with scripted outputs; flags switch failure modes."""

    def __init__(self, tokenizer: Any | None, *, max_model_len: int = 32, vocab_size: int = 20) -> None:
        self.model_info = WorkerDescription(model_name="fake-model", dtype="float32", block_size=16,
                                            max_model_len=max_model_len, vocab_size=vocab_size, num_kv_blocks=8,
                                            device="cpu", eos_token_ids=(EOS_ID,))
        self.tokenizer = tokenizer
        self.metrics = ServiceMetrics()
        self.ready = True
        self.queue_full = False
        self.crash = False
        self.hang_after_first_output = False
        self.script: Callable[[list[int], SamplingParams], list[RequestOutput]] = default_script
        self.requests: list[tuple[list[int], SamplingParams]] = []
        self.num_closed = 0  # generate() iterators that ended, however (finished, cancelled, closed)
        self.has_constraints = False  # the word-level tokenizer is not one llguidance reads
        self.max_grammar_compile_ms = 2000

    @property
    def is_ready(self) -> bool:
        return self.ready

    def worker_stats(self) -> list[tuple[str, EngineStats]]:
        """One worker with three requests running, one waiting, 5 of 8 blocks in use."""
        return [("fake-worker", EngineStats(True, 3, 1, 8, 3))]

    def validate(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise RequestError("prompt: must not be empty")
        if len(prompt_token_ids) >= self.model_info.max_model_len:
            raise RequestError(f"prompt: {len(prompt_token_ids)} tokens, the limit is {self.model_info.max_model_len}")

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        if not self.ready:
            raise EngineUnavailableError("engine: no worker is ready")
        if self.queue_full:
            raise QueueFullError("queue: full (4 requests)")
        if self.crash:
            raise RuntimeError("simulated bug")
        self.validate(prompt_token_ids)
        self.requests.append((prompt_token_ids, params))
        try:
            for output in self.script(prompt_token_ids, params):
                yield output
                if self.hang_after_first_output:
                    await asyncio.Event().wait()
        finally:
            self.num_closed += 1


class ServerThread(PublicServerThread):
    """Runs build_public_server(engine) on its own event loop in a daemon thread."""

    run_timeout = 10.0

    def __init__(self, engine: FakeEngine, **options: Any) -> None:
        super().__init__()
        self.engine = engine
        self.options = options  # for build_public_server: config, api_keys

    def start(self) -> ServerThread:
        self.loop_thread = LoopThread("public-server")
        self.run(self.serve(self.engine, **self.options))
        return self

    def stop(self) -> None:
        if self.public is not None:
            self.run(self.public.stop(grace=None))
        if self.loop_thread is not None:
            self.loop_thread.close()
