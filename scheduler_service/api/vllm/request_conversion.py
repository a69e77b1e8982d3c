"""vllm.grpc.engine GenerateRequests -> what the engine takes: prompt token ids and SamplingParams.

The same checks and the same statuses as our own API (request_conversion): every refusal is a
RequestError (INVALID_ARGUMENT) whose message starts with the field's path in this proto
(`sampling_params.top_p`, `tokenized.input_ids`). A field we cannot honour is refused by name,
never ignored: structural tags, prompt truncation, "all" (-1) logprobs, multimodal inputs and the
disaggregation fields.

proto3 cannot tell an unset plain scalar from zero, so the zeros that vLLM itself reads as "unset"
are read so here too: top_p 0 and repetition_penalty 0 mean 1 (neither is a valid value), top_k 0
means no limit, n 0 means 1, json_object false means no constraint. skip_special_tokens and
spaces_between_special_tokens shape text, which this dialect never returns (the gateway detokenizes
the ids), so they change nothing. grammar_from_first_token changes nothing either: this engine runs
no reasoning parser, so a constraint always starts at the first generated token.
"""
from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from smg_grpc_proto.generated import vllm_engine_pb2

from common.contract.constraint import Constraint
from common.contract.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from common.contract.worker_description import WorkerDescription
from scheduler_service.api.request_conversion import (
    MAX_REQUEST_ID_BYTES,
    check_vocabulary,
    constraint_in,
    encode_text,
    float32_value,
)
from scheduler_service.core.errors import RequestError

if TYPE_CHECKING:
    from scheduler_service.api.tokenizer import Tokenizer

# Our SamplingParams field -> its path in this proto, for error messages.
_PARAM_TO_FIELD = {
    "include_stop_in_output": "sampling_params.include_stop_str_in_output",
    "num_top_logprobs": "sampling_params.logprobs",
    "num_prompt_logprobs": "sampling_params.prompt_logprobs",
}
# Request fields of modes this engine does not have: multimodal inputs and prefill/decode disaggregation.
_UNSUPPORTED_REQUEST_FIELDS = {
    "mm_inputs": "multimodal inputs are not supported (a text-only engine)",
    "media_refs": "multimodal inputs are not supported (a text-only engine)",
    "kv_transfer_params": "KV transfer (prefill/decode disaggregation) is not supported",
    "kv_transfer_params_json": "KV transfer (prefill/decode disaggregation) is not supported",
    "data_parallel_rank": "pinning a data-parallel rank is not supported (the engine balances its lanes itself; "
                          "GetServerInfo reports data_parallel_size 1)",
}


def request_id_of(request: vllm_engine_pb2.GenerateRequest) -> str:
    """The gateway's request id (what Abort names), or a fresh one so that every log line names the request."""
    num_bytes = len(request.request_id.encode())
    if num_bytes > MAX_REQUEST_ID_BYTES:
        raise RequestError(f"request_id: at most {MAX_REQUEST_ID_BYTES} bytes, got {num_bytes}")
    return request.request_id or uuid.uuid4().hex


def check_supported(request: vllm_engine_pb2.GenerateRequest) -> None:
    """Refuses, by name, the request fields of modes this engine does not have."""
    for name, reason in _UNSUPPORTED_REQUEST_FIELDS.items():
        if request.HasField(name):
            raise RequestError(f"{name}: {reason}")
    if request.extra_mm_inputs:
        raise RequestError(f"extra_mm_inputs: {_UNSUPPORTED_REQUEST_FIELDS['mm_inputs']}")


def prompt_token_ids(request: vllm_engine_pb2.GenerateRequest, tokenizer: Tokenizer | None,
                     model_info: WorkerDescription) -> list[int]:
    """The prompt as token ids (the gateway sends `tokenized`; `text` needs our tokenizer)."""
    kind = request.WhichOneof("input")
    if kind == "tokenized":
        ids = list(request.tokenized.input_ids)
        if not ids:
            raise RequestError("tokenized.input_ids: must not be empty")
        check_vocabulary(ids, "tokenized.input_ids", model_info.vocab_size)
    elif kind == "text":
        if not request.text:
            raise RequestError("text: must not be empty")
        ids = encode_text(tokenizer, request.text, add_special_tokens=True, max_tokens=model_info.max_model_len)
        if not ids:
            raise RequestError("text: the prompt tokenizes to no tokens")
    else:
        raise RequestError("input: set one of tokenized or text")
    limit = model_info.max_model_len - 1
    if len(ids) > limit:
        raise RequestError(f"prompt: {len(ids)} tokens, the limit is {limit} "
                           f"(max_model_len {model_info.max_model_len} minus one generated token)")
    return ids


def _check_sampling_supported(params: vllm_engine_pb2.SamplingParams) -> None:
    if params.WhichOneof("constraint") == "structural_tag":
        raise RequestError("sampling_params.structural_tag: structural tags are not supported "
                           "(json_schema, regex, grammar, json_object and choice are)")
    for name in ("logprobs", "prompt_logprobs"):
        if params.HasField(name) and getattr(params, name) < 0:
            raise RequestError(f"sampling_params.{name}: must be in [0, {MAX_TOP_LOGPROBS}], got "
                               f"{getattr(params, name)} (-1, every token of the vocabulary, is not supported)")
    if params.HasField("truncate_prompt_tokens"):
        raise RequestError("sampling_params.truncate_prompt_tokens: prompt truncation is not supported")


def constraint_of(params: vllm_engine_pb2.SamplingParams) -> Constraint | None:
    """The request's structured-output constraint (None: free text); errors name this proto's field."""
    kind = params.WhichOneof("constraint")
    if kind is None:
        return None
    try:
        return constraint_in(params, kind)
    except ValueError as exc:
        raise RequestError(vllm_field_message(str(exc))) from exc


def vllm_field_message(message: str) -> str:
    """A constraint's error (`constraint.regex: ...`) as this proto names the field (`sampling_params.regex`);
    any other message as it is."""
    if not message.startswith("constraint."):
        return message
    return "sampling_params." + message.removeprefix("constraint.")


def sampling_params(request: vllm_engine_pb2.GenerateRequest, num_prompt_tokens: int,
                    model_info: WorkerDescription) -> SamplingParams:
    """Our SamplingParams from the request's; unset max_tokens fills the room the context leaves."""
    params = request.sampling_params
    _check_sampling_supported(params)
    values: dict[str, Any] = {
        "top_p": float32_value(params.top_p) if params.top_p else 1.0,
        "top_k": params.top_k or -1,
        "min_p": float32_value(params.min_p),
        "frequency_penalty": float32_value(params.frequency_penalty),
        "presence_penalty": float32_value(params.presence_penalty),
        "repetition_penalty": float32_value(params.repetition_penalty) if params.repetition_penalty else 1.0,
        "stop": tuple(params.stop),
        "stop_token_ids": tuple(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
        "include_stop_in_output": params.include_stop_str_in_output,
        "n": params.n or 1,
        "min_tokens": params.min_tokens,
        "logit_bias": tuple(sorted(params.logit_bias.items())),
        "constraint": constraint_of(params),
    }
    if params.HasField("temperature"):
        values["temperature"] = float32_value(params.temperature)
    if params.HasField("seed"):
        values["seed"] = params.seed
    if params.HasField("logprobs"):  # vLLM's: the sampled token's logprob and this many alternatives
        values["logprobs"], values["num_top_logprobs"] = True, params.logprobs
    if params.HasField("prompt_logprobs"):
        values["num_prompt_logprobs"] = params.prompt_logprobs
    room = model_info.max_model_len - num_prompt_tokens
    values["max_tokens"] = params.max_tokens if params.HasField("max_tokens") else room
    if values["max_tokens"] > room:
        raise RequestError(f"sampling_params.max_tokens: {params.max_tokens} + {num_prompt_tokens} prompt tokens "
                           f"exceed max_model_len {model_info.max_model_len} (at most {room})")
    check_vocabulary(list(params.stop_token_ids), "sampling_params.stop_token_ids", model_info.vocab_size)
    check_vocabulary(sorted(params.logit_bias), "sampling_params.logit_bias", model_info.vocab_size)
    try:
        return SamplingParams(**values)
    except ValueError as exc:
        field, sep, rest = str(exc).partition(":")
        raise RequestError(f"{_PARAM_TO_FIELD.get(field, f'sampling_params.{field}')}{sep}{rest}") from exc
