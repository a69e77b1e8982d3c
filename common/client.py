"""A small synchronous Python client of the public TextGeneration service.

    with GenerationClient("localhost:50051", timeout=60) as client:
        client.wait_ready(timeout=300)
        result = client.generate("The capital of France is", max_tokens=16, temperature=0)
        for delta in client.stream(messages=[{"role": "user", "content": "Hi!"}], max_tokens=64):
            print(delta.text, end="", flush=True)

Over TLS with an API key (the server's --tls-cert / --api-key-file):

    GenerationClient("api.example:50051", ca_cert="ca.pem", api_key=os.environ["NANOVLLM_API_KEY"])

Errors arrive as grpc.RpcError (code() and details() say what was wrong, e.g. INVALID_ARGUMENT
"max_tokens: ..."); leaving a stream early cancels the request on the server.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.contract.sampling_params import PARAMS
from common.generated.nanovllm.generate.v1 import generate_pb2, generate_pb2_grpc
from common.net import grpc_options
from common.security.tls import channel_credentials

Message = Mapping[str, str] | tuple[str, str]  # {"role": ..., "content": ...} or (role, content)

# GenerateRequest fields that generate() and stream() take as keyword arguments.
SAMPLING_FIELDS = frozenset(p.public for p in PARAMS)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


@dataclass(frozen=True)
class Sample:
    """One of the n samples of a request (n > 1)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    matched_stop: str | int | None
    logprobs: list[TokenLogprob]


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "length", "stop", "stop_sequence" or "aborted"
    matched_stop: str | int | None  # the stop string, or the EOS / stop token id
    usage: Usage  # with n > 1: every sample's completion tokens, the prompt's once
    logprobs: list[TokenLogprob]
    # The fields above are sample 0's; with n > 1, every sample in index order (sample 0 first).
    samples: list[Sample] = field(default_factory=list)


@dataclass(frozen=True)
class StreamDelta:
    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None  # set on the last delta only
    matched_stop: str | int | None
    usage: Usage | None  # set on the last delta only (of each sample: its own completion tokens)
    index: int = 0  # the sample it belongs to (n > 1: the samples' deltas interleave)


def build_request(prompt: str | Sequence[int] | None = None, *, messages: Iterable[Message] | None = None,
                  request_id: str = "", **sampling: object) -> generate_pb2.GenerateRequest:
    """A GenerateRequest from a text or token-id prompt, or chat messages; sampling keyword arguments
    are GenerateRequest fields (None leaves a field unset, i.e. at the server's default)."""
    unknown = sorted(set(sampling) - SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"unknown sampling argument {unknown[0]!r} (known: {sorted(SAMPLING_FIELDS)})")
    if (prompt is None) == (messages is None):
        raise TypeError("pass either a prompt (text or token ids) or messages")
    request = generate_pb2.GenerateRequest(
        request_id=request_id, **{k: v for k, v in sampling.items() if v is not None})  # type: ignore[arg-type]
    if messages is not None:
        request.chat.CopyFrom(chat_messages(messages))
    elif isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return request


def chat_messages(messages: Iterable[Message]) -> generate_pb2.ChatMessages:
    chat = generate_pb2.ChatMessages()
    for message in messages:
        role, content = (message["role"], message["content"]) if isinstance(message, Mapping) else message
        chat.messages.add(role=role, content=content)
    return chat


def _finish_reason(value: int) -> str | None:
    if value == generate_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    return generate_pb2.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()


def _matched_stop(message: generate_pb2.GenerateResponse | generate_pb2.GenerateStreamResponse
                  | generate_pb2.Sample) -> str | int | None:
    kind = message.WhichOneof("matched_stop")
    return getattr(message, kind) if kind else None


def _logprobs(entries: Iterable[generate_pb2.TokenLogprob]) -> list[TokenLogprob]:
    return [TokenLogprob(e.token_id, e.logprob, tuple((t.token_id, t.logprob) for t in e.top_logprobs))
            for e in entries]


def _usage(usage: generate_pb2.Usage) -> Usage:
    return Usage(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)


_CONNECT_PREFIX = "failed to connect to all addresses; last error: "


def connection_failure(error: grpc.RpcError, *, tls: bool, client_cert: bool = False) -> str:
    """One line saying why a call failed: "<CODE>: <what happened>", for `nanovllm health` and other
    probes. A connection that failed says what it met (nothing listening, no gRPC server, a
    certificate its CA does not verify, a port that does not speak TLS or that closed the
    handshake) and, only where it can be the cause, how to dial instead (tls: dialed with TLS;
    client_cert: with a client certificate). gRPC's own wording is kept after the explanation,
    without its prefix and its trailing ": OK"."""
    code, details = error.code(), (error.details() or "")
    reason = details.removeprefix(_CONNECT_PREFIX).removesuffix(": OK")
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"{code.name}: no answer before the deadline ({reason})"
    if code is not grpc.StatusCode.UNAVAILABLE:
        return f"{code.name}: {reason}"
    if "Connection refused" in details:
        return f"{code.name}: nothing listens there ({reason})"
    if "Failed parsing HTTP/2" in details or "SETTINGS frame" in details:
        return f"{code.name}: not a gRPC server: the port answers, but not in HTTP/2 (an HTTP port such as the " \
               "metrics port?)"
    if "CERTIFICATE_VERIFY_FAILED" in details:
        why = reason.rsplit("CERTIFICATE_VERIFY_FAILED: ", 1)[-1]
        signer = "--ca-cert" if tls else "the system's root certificates"
        return f"{code.name}: TLS: the server's certificate is not signed by the CA of {signer} ({why})"
    if "not in peer certificate" in details or "Peer name" in details:
        return f"{code.name}: TLS: the server's certificate does not name the host dialed: dial a name it holds " \
               f"({reason})"
    if "WRONG_VERSION_NUMBER" in details:
        return f"{code.name} (dialed with TLS: a plaintext port takes no --ca-cert): the port does not speak TLS"
    if not tls:
        return f"{code.name} (dialed in plaintext: a TLS port needs --ca-cert; mTLS also --client-cert, " \
               f"--client-key): {reason}"
    if not client_cert:
        return f"{code.name} (dialed with TLS: a plaintext port takes no --ca-cert; mTLS needs --client-cert, " \
               f"--client-key): {reason}"
    return f"{code.name} (dialed with mTLS: is --client-cert signed by the CA the port requires?): {reason}"


class GenerationClient:
    """Client of one server. `timeout` (seconds) is the default deadline of every call; None waits
    forever. Usable as a context manager, which closes the channel.

    TLS when `tls` is true or any of ca_cert, client_cert, client_key is given (PEM file paths; no
    ca_cert: the system's root certificates; common.security.tls reads them: ValueError for a file it cannot read,
    or client_cert without client_key). `api_key` is sent as `authorization: Bearer <key>` with every call."""

    def __init__(self, target: str, *, timeout: float | None = None, tls: bool = False,
                 ca_cert: str | Path | None = None, client_cert: str | Path | None = None,
                 client_key: str | Path | None = None, api_key: str | None = None) -> None:
        self.target = target
        self.timeout = timeout
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        # The same keepalive and message-size options as the server expects: pings during long
        # prefills keep the quiet connection alive through proxies.
        if tls or ca_cert is not None or client_cert is not None or client_key is not None:
            credentials = channel_credentials(ca_cert, client_cert, client_key)
            self.channel = grpc.secure_channel(target, credentials, options=grpc_options.channel_options())
        else:
            self.channel = grpc.insecure_channel(target, options=grpc_options.channel_options())
        self.stub = generate_pb2_grpc.TextGenerationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def generate(self, prompt: str | Sequence[int] | None = None, *, messages: Iterable[Message] | None = None,
                 request_id: str = "", timeout: float | None = None, **sampling: object) -> GenerationResult:
        """Generates a whole completion; see GenerateRequest in generate.proto for the arguments."""
        request = build_request(prompt, messages=messages, request_id=request_id, **sampling)
        response = self.stub.Generate(request, timeout=self._timeout(timeout), metadata=self._metadata)
        return GenerationResult(
            request_id=response.request_id, text=response.text, token_ids=list(response.token_ids),
            finish_reason=_finish_reason(response.finish_reason) or "", matched_stop=_matched_stop(response),
            usage=_usage(response.usage), logprobs=_logprobs(response.logprobs),
            samples=[Sample(s.index, s.text, list(s.token_ids), _finish_reason(s.finish_reason) or "",
                            _matched_stop(s), _logprobs(s.logprobs)) for s in response.samples])

    def stream(self, prompt: str | Sequence[int] | None = None, *, messages: Iterable[Message] | None = None,
               request_id: str = "", timeout: float | None = None, **sampling: object) -> Iterator[StreamDelta]:
        """Yields deltas as they are generated; the last one has finish_reason and usage set (with n > 1:
        the last of each sample, the deltas of the samples interleaved, each naming its index).
        Stopping the iteration early (break, close()) cancels the request on the server."""
        request = build_request(prompt, messages=messages, request_id=request_id, **sampling)
        call = self.stub.GenerateStream(request, timeout=self._timeout(timeout), metadata=self._metadata)
        try:
            for message in call:
                yield StreamDelta(
                    request_id=message.request_id, text=message.text, token_ids=list(message.token_ids),
                    logprobs=_logprobs(message.logprobs), finish_reason=_finish_reason(message.finish_reason),
                    matched_stop=_matched_stop(message),
                    usage=_usage(message.usage) if message.HasField("usage") else None, index=message.index)
        finally:
            call.cancel()  # a no-op once the stream has ended

    def tokenize(self, text: str | None = None, *, messages: Iterable[Message] | None = None,
                 add_special_tokens: bool | None = None, timeout: float | None = None) -> list[int]:
        if (text is None) == (messages is None):
            raise TypeError("pass either text or messages")
        request = generate_pb2.TokenizeRequest()
        if messages is not None:
            request.chat.CopyFrom(chat_messages(messages))
        else:
            request.text = text  # type: ignore[assignment]
        if add_special_tokens is not None:
            request.add_special_tokens = add_special_tokens
        return list(self.stub.Tokenize(request, timeout=self._timeout(timeout), metadata=self._metadata).token_ids)

    def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False,
                   timeout: float | None = None) -> str:
        request = generate_pb2.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens)
        return self.stub.Detokenize(request, timeout=self._timeout(timeout), metadata=self._metadata).text

    def model_info(self, *, timeout: float | None = None) -> generate_pb2.GetModelInfoResponse:
        return self.stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=self._timeout(timeout),
                                 metadata=self._metadata)

    def health_status(self, service: str = "", *, timeout: float | None = None) -> str:
        """The grpc.health.v1 status of `service` ("" = the whole server): SERVING, NOT_SERVING, ..."""
        response = self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=self._timeout(timeout),
                                     metadata=self._metadata)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def wait_ready(self, timeout: float) -> None:
        """Waits until the server reports SERVING (a worker is ready); raises TimeoutError after
        `timeout` seconds. Also waits through connection errors, for a server still starting."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.target} not SERVING after {timeout} s (last: {last})")
            try:
                last = self.health_status(timeout=min(remaining, 5.0))
                if last == "SERVING":
                    return
            except grpc.RpcError as exc:
                last = f"{exc.code().name}: {exc.details()}"
            time.sleep(min(0.1, max(deadline - time.monotonic(), 0)))

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
