"""Engine outputs (RequestOutput deltas) -> public API responses."""
from __future__ import annotations

import re
from pathlib import PurePath

from common.contract.constraint import MAX_CONSTRAINT_BYTES
from common.contract.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
)
from common.contract.worker_description import WorkerDescription
from common.generated.nanovllm.generate.v1 import generate_pb2
from scheduler_service.core.outputs import RequestOutput
from scheduler_service.core.sequence import FinishReason
from scheduler_service.observe.load_report import LoadReport

FINISH_REASON_TO_PROTO = {
    FinishReason.LENGTH: generate_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: generate_pb2.FINISH_REASON_STOP,
    FinishReason.STOP_SEQUENCE: generate_pb2.FINISH_REASON_STOP_SEQUENCE,
    FinishReason.ABORTED: generate_pb2.FINISH_REASON_ABORTED,
}

Response = generate_pb2.GenerateResponse | generate_pb2.GenerateStreamResponse


def token_logprobs(output: RequestOutput) -> list[generate_pb2.TokenLogprob]:
    """One entry per token of the delta, when the request asked for logprobs (else empty)."""
    if not output.logprobs:
        return []
    tops = output.top_logprobs or [[] for _ in output.logprobs]
    return [_token_logprob(*score) for score in zip(output.token_ids, output.logprobs, tops, strict=False)]


def prompt_token_logprobs(output: RequestOutput) -> list[generate_pb2.TokenLogprob]:
    """The prompt tokens' scores, on the output that carries them (else empty)."""
    if output.prompt_logprobs is None:
        return []
    return [_token_logprob(*score) for score in output.prompt_logprobs]


def _token_logprob(token_id: int, logprob: float, top: list[tuple[int, float]]) -> generate_pb2.TokenLogprob:
    return generate_pb2.TokenLogprob(token_id=token_id, logprob=logprob,
                                     top_logprobs=[generate_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in top])


def set_final_fields(message: Response, output: RequestOutput) -> None:
    """Finish reason, matched stop and usage, which only the last output carries."""
    if output.finish_reason is not None:
        message.finish_reason = FINISH_REASON_TO_PROTO[output.finish_reason]
    if isinstance(output.matched_stop, str):
        message.matched_stop_string = output.matched_stop
    elif isinstance(output.matched_stop, int):
        message.matched_stop_token_id = output.matched_stop
    message.usage.CopyFrom(generate_pb2.Usage(
        prompt_tokens=output.num_prompt_tokens,
        completion_tokens=output.num_output_tokens,
        cached_tokens=output.num_cached_tokens,
    ))


def stream_response(request_id: str, output: RequestOutput) -> generate_pb2.GenerateStreamResponse:
    message = generate_pb2.GenerateStreamResponse(request_id=request_id, text=output.text, token_ids=output.token_ids)
    if output.index:
        message.index = output.index
    if output.logprobs:
        message.logprobs.extend(token_logprobs(output))
    if output.prompt_logprobs is not None:
        message.prompt_logprobs.extend(prompt_token_logprobs(output))
    if output.finished:
        set_final_fields(message, output)
    return message


class ResponseAccumulator:
    """Gathers a request's deltas into one GenerateResponse (the unary Generate). With n > 1 samples
    this one gathers sample 0 (the top-level fields) and one more per other sample gathers that one;
    result() lists them all in `samples` and sums their completion tokens."""

    def __init__(self, request_id: str, num_samples: int = 1) -> None:
        self.response = generate_pb2.GenerateResponse(request_id=request_id)
        self.text_parts: list[str] = []
        self.others = [ResponseAccumulator(request_id) for _ in range(num_samples - 1)]

    def add(self, output: RequestOutput) -> None:
        if output.index and self.others:  # another sample's: its own accumulator (which has no others)
            self.others[output.index - 1].add(output)
            return
        self.text_parts.append(output.text)
        self.response.token_ids.extend(output.token_ids)
        if output.logprobs:
            self.response.logprobs.extend(token_logprobs(output))
        if output.prompt_logprobs is not None:
            self.response.prompt_logprobs.extend(prompt_token_logprobs(output))
        if output.finished:
            set_final_fields(self.response, output)

    def result(self) -> generate_pb2.GenerateResponse:
        self.response.text = "".join(self.text_parts)
        if self.others:
            responses = [self.response, *(other.result() for other in self.others)]
            samples = [_sample(index, response) for index, response in enumerate(responses)]
            self.response.samples.extend(samples)
            self.response.usage.completion_tokens = sum(r.usage.completion_tokens for r in responses)
        return self.response


def _sample(index: int, response: generate_pb2.GenerateResponse) -> generate_pb2.Sample:
    """One sample's fields, from the response that gathered it."""
    sample = generate_pb2.Sample(index=index, text=response.text, token_ids=response.token_ids,
                                 finish_reason=response.finish_reason, logprobs=response.logprobs)
    kind = response.WhichOneof("matched_stop")
    if kind is not None:
        setattr(sample, kind, getattr(response, kind))
    return sample


# A Hugging Face cache snapshot: .../models--<org>--<name>/snapshots/<revision>
_HUB_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/[^/]+/?$")


def default_served_name(model_path: str) -> str:
    """The name a model is served under when --served-model-name is not given, from the worker's
    model path: a checkpoint folder's name, a GGUF file's stem, a Hugging Face cache snapshot's
    org/name; anything else as it is."""
    hub = _HUB_SNAPSHOT.search(model_path.replace("\\", "/"))
    if hub is not None:
        return f"{hub['org']}/{hub['name']}"
    path = PurePath(model_path)
    if not path.name:  # "", "/"
        return model_path
    return path.stem if path.suffix.lower() == ".gguf" else path.name


def model_info_response(model_info: WorkerDescription, tokenizer: object | None, model_name: str, *,
                        has_constraints: bool = False,
                        max_grammar_compile_ms: int = 0) -> generate_pb2.GetModelInfoResponse:
    """model_name: the served name (--served-model-name, or default_served_name of the path);
    has_constraints: whether structured output is offered, within max_grammar_compile_ms."""
    return generate_pb2.GetModelInfoResponse(
        model_name=model_name,
        max_model_len=model_info.max_model_len,
        vocab_size=model_info.vocab_size,
        eos_token_ids=sorted(model_info.eos_token_ids),
        max_stop_strings=MAX_STOP_STRINGS,
        max_stop_string_chars=MAX_STOP_STRING_CHARS,
        max_top_logprobs=MAX_TOP_LOGPROBS,
        max_n=MAX_N,
        max_logit_bias=MAX_LOGIT_BIAS,
        max_grammar_compile_ms=max_grammar_compile_ms,
        max_constraint_bytes=MAX_CONSTRAINT_BYTES,
        has_constraints=has_constraints,
        has_tokenizer=tokenizer is not None,
        has_chat_template=getattr(tokenizer, "chat_template", None) is not None,
        block_size=model_info.block_size,
        num_kv_blocks=model_info.num_kv_blocks,
    )


def load_response(report: LoadReport) -> generate_pb2.GetLoadResponse:
    return generate_pb2.GetLoadResponse(
        num_requests_running=report.num_running,
        num_requests_waiting=report.num_waiting,
        kv_cache_usage=report.kv_cache_usage,
        num_workers_ready=report.num_workers_ready,
        workers=[generate_pb2.WorkerLoad(
            address=address, ready=w.is_attached, num_requests_running=w.num_running,
            num_requests_waiting=w.num_waiting, kv_cache_usage=w.kv_cache_usage, num_kv_blocks=w.num_kv_blocks,
            num_free_kv_blocks=w.num_free_kv_blocks) for address, w in report.workers],
    )
