"""Public API requests -> what the engine takes: prompt token ids and SamplingParams.

Every check here raises RequestError (INVALID_ARGUMENT) whose message starts with the public field
name and states the limit. The engine validates again (prompt length, vocabulary); the checks
repeated here are those the defaults depend on (max_tokens fills the context the prompt leaves) or
that name a public field the engine does not know (token_ids, chat, top_logprobs).
"""
from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

import numpy as np
from jinja2.exceptions import TemplateError

from common.contract.constraint import Constraint
from common.contract.quoting import quote
from common.contract.sampling_params import PARAMS, SamplingParams, values_of
from common.contract.worker_description import WorkerDescription
from common.generated.nanovllm.generate.v1 import generate_pb2
from scheduler_service.core.errors import RequestError

if TYPE_CHECKING:
    from scheduler_service.api.tokenizer import Tokenizer

CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_REQUEST_ID_BYTES = 256
# For error messages: SamplingParams names the field by its own name.
_PARAM_TO_PUBLIC_FIELD = {p.name: p.public for p in PARAMS}


def request_id_of(request: generate_pb2.GenerateRequest) -> str:
    """The client's request id, or a fresh random one so that every log line can name the request."""
    num_bytes = len(request.request_id.encode())
    if num_bytes > MAX_REQUEST_ID_BYTES:  # it is echoed in every response and log line
        raise RequestError(f"request_id: at most {MAX_REQUEST_ID_BYTES} bytes, got {num_bytes}")
    return request.request_id or uuid.uuid4().hex


def prompt_token_ids(request: generate_pb2.GenerateRequest, tokenizer: Tokenizer | None,
                     model_info: WorkerDescription) -> list[int]:
    """The prompt as token ids, whichever form it came in; checks emptiness, vocabulary, length."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        if not request.text:
            raise RequestError("text: must not be empty")
        ids = encode_text(tokenizer, request.text, add_special_tokens=True, max_tokens=model_info.max_model_len)
    elif kind == "token_ids":
        ids = list(request.token_ids.ids)
        if not ids:
            raise RequestError("token_ids: must not be empty")
        check_vocabulary(ids, "token_ids", model_info.vocab_size)
    elif kind == "chat":
        ids = encode_chat(tokenizer, request.chat, max_tokens=model_info.max_model_len)
    else:
        raise RequestError("prompt: set one of text, token_ids or chat")
    if not ids:
        raise RequestError(f"{kind}: the prompt tokenizes to no tokens")
    limit = model_info.max_model_len - 1
    if len(ids) > limit:
        raise RequestError(f"prompt: {len(ids)} tokens, the limit is {limit} "
                           f"(max_model_len {model_info.max_model_len} minus one generated token)")
    return ids


def encode_text(tokenizer: Tokenizer | None, text: str, add_special_tokens: bool,
                max_tokens: int | None = None) -> list[int]:
    if tokenizer is None:
        raise RequestError("text: this model has no tokenizer; send token_ids")
    check_fits(tokenizer, len(text.encode()), "text", max_tokens)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def encode_chat(tokenizer: Tokenizer | None, chat: generate_pb2.ChatMessages,
                max_tokens: int | None = None) -> list[int]:
    """Applies the model's chat template with the generation prompt, then tokenizes."""
    if tokenizer is None:
        raise RequestError("chat: this model has no tokenizer; send token_ids")
    if getattr(tokenizer, "chat_template", None) is None:
        raise RequestError("chat: this model's tokenizer has no chat template; send text or token_ids")
    if not chat.messages:
        raise RequestError("chat.messages: must not be empty")
    for index, message in enumerate(chat.messages):
        if message.role not in CHAT_ROLES:
            raise RequestError(f"chat.messages[{index}].role: must be one of {', '.join(CHAT_ROLES)}; "
                               f"got {quote(message.role)}")
    check_fits(tokenizer, sum(len(m.content.encode()) for m in chat.messages), "chat.messages", max_tokens)
    messages = [{"role": m.role, "content": m.content} for m in chat.messages]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except (TemplateError, ValueError) as exc:  # e.g. a template that demands alternating roles
        raise RequestError(f"chat.messages: the model's chat template rejected them: {quote(str(exc))}") from exc
    # The template already holds BOS and the like; adding special tokens again would double them.
    return list(tokenizer.encode(text, add_special_tokens=False))


def check_fits(tokenizer: Tokenizer, num_bytes: int, field: str, max_tokens: int | None) -> None:
    """Refuses, before tokenizing it, text that cannot fit max_tokens tokens whatever it says:
    tokenizing megabytes takes seconds of the one tokenizer thread that all requests share. Twice
    the bytes any max_tokens tokens stand for (a normalizer may shorten text). None: no bound."""
    if max_tokens is None:
        return
    limit = 2 * max_tokens * tokenizer.max_token_bytes
    if num_bytes > limit:
        raise RequestError(f"{field}: {num_bytes} bytes of text cannot fit {max_tokens} tokens "
                           f"(max_model_len; at most {limit} bytes)")


def check_vocabulary(token_ids: list[int], field: str, vocab_size: int) -> None:
    for index, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            raise RequestError(f"{field}: token id {token_id} at index {index} is outside the vocabulary "
                               f"[0, {vocab_size})")


def sampling_params(request: generate_pb2.GenerateRequest, num_prompt_tokens: int,
                    model_info: WorkerDescription) -> SamplingParams:
    """SamplingParams from the request; unset fields take SamplingParams' defaults, except
    max_tokens, which defaults to the room the context leaves after the prompt."""
    values = {name: float32_value(value) if isinstance(value, float) else value
              for name, value in values_of(request, PARAMS, lambda p: p.public).items()}
    room = model_info.max_model_len - num_prompt_tokens
    if values.setdefault("max_tokens", room) > room:
        raise RequestError(f"max_tokens: {request.max_tokens} + {num_prompt_tokens} prompt tokens exceed "
                           f"max_model_len {model_info.max_model_len} (at most {room})")
    check_vocabulary(list(request.stop_token_ids), "stop_token_ids", model_info.vocab_size)
    check_vocabulary(sorted(request.logit_bias), "logit_bias", model_info.vocab_size)
    values["constraint"] = constraint_of(request.constraint) if request.HasField("constraint") else None
    try:
        return SamplingParams(**values)
    except ValueError as exc:
        raise RequestError(_public_message(str(exc))) from exc


def constraint_of(message: generate_pb2.Constraint) -> Constraint | None:
    """The request's structured-output constraint; None for none (json_object: false included). Its
    errors name the public field (`constraint.regex: must not be empty`); compiling it is the engine's."""
    kind = message.WhichOneof("kind")
    if kind is None:
        raise RequestError("constraint: set one of json_schema, json_object, regex, grammar or choice")
    try:
        return constraint_in(message, kind)
    except ValueError as exc:
        raise RequestError(str(exc)) from exc


def constraint_in(message: Any, kind: str) -> Constraint | None:
    """The constraint a message's oneof holds (kind: its set field), for both public protos, which spell
    the fields alike (json_schema, json_object, regex, grammar, choice.choices); None for json_object
    false. Raises ValueError naming `constraint.<field>`."""
    if kind == "json_object" and not message.json_object:
        return None
    value: str | tuple[str, ...] = ""
    if kind == "choice":
        value = tuple(message.choice.choices)
    elif kind != "json_object":
        value = getattr(message, kind)
    return Constraint(kind, value)


def float32_value(value: float) -> float:
    """The shortest decimal that the wire's float32 stands for: 0.7 rather than 0.699999988, so that
    error messages echo what the client sent."""
    return float(str(np.float32(value)))


def _public_message(message: str) -> str:
    field, sep, rest = message.partition(":")
    return f"{_PARAM_TO_PUBLIC_FIELD.get(field, field)}{sep}{rest}"
