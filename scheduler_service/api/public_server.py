"""The public gRPC server: the TextGeneration service, vllm.grpc.engine.VllmEngine (api/vllm/,
for gateways), grpc.health.v1 and server reflection.

The servicer is thin: it converts a request (request_conversion), makes one engine call and
converts the outputs back (response_conversion); exceptions become status codes in one place
(common.net.error_mapping, with api/statuses.py's STATUSES).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from common.contract.config import PublicServerConfig
from common.contract.sampling_params import SamplingParams
from common.contract.worker_description import WorkerDescription
from common.generated.nanovllm.generate.v1 import generate_pb2, generate_pb2_grpc
from common.net import grpc_options
from common.net.ports import PUBLIC_PORT_IN_USE, listen
from common.net.ports import PortInUseError as PortInUseError  # what build_public_server raises
from common.security.api_keys import API_KEY_REFUSAL, ApiKeys
from common.security.bearer_auth import BearerTokenInterceptor
from common.security.grpc_logs import install_grpc_log_filter
from common.security.metadata_check import MetadataCheckInterceptor
from common.security.reloading_tls import ReloadingCertificates
from scheduler_service.api import request_conversion as convert
from scheduler_service.api.reflection_pool import public_descriptor_pool
from scheduler_service.api.refused_calls import DEFAULT_INTERVAL_S, RefusedCalls
from scheduler_service.api.request_record import RequestRecord
from scheduler_service.api.response_conversion import (
    ResponseAccumulator,
    default_served_name,
    load_response,
    model_info_response,
    stream_response,
)
from scheduler_service.api.statuses import STATUSES
from scheduler_service.api.vllm.servicer import SERVICE_NAME as VLLM_SERVICE_NAME
from scheduler_service.api.vllm.servicer import VllmEngineServicer
from scheduler_service.core.errors import EngineUnavailableError, RequestError
from scheduler_service.core.outputs import EngineStats, RequestOutput
from scheduler_service.observe.load_report import LoadReport
from scheduler_service.observe.metrics import ServiceMetrics

logger = logging.getLogger(__name__)

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["TextGeneration"].full_name
MAX_PENDING_CALLS = 1 << 20


class Engine(Protocol):
    """What the public server needs of scheduler_service.lanes.async_engine.AsyncEngine."""

    model_info: WorkerDescription | None  # None until a worker has connected once
    tokenizer: Any | None

    @property
    def is_ready(self) -> bool: ...

    @property
    def has_constraints(self) -> bool:
        """Whether requests may carry a constraint (structured output)."""

    @property
    def max_grammar_compile_ms(self) -> int: ...

    def worker_stats(self) -> list[tuple[str, EngineStats]]:
        """Each lane's address and stats: running and waiting requests, KV usage."""

    def generate(self, prompt_token_ids: list[int], params: SamplingParams) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs (with params.n > 1, every sample's, each tagged with its index).
        Closing the generator early aborts the request and frees its KV blocks. The handlers close
        it as soon as they end, however they end: when the client cancels while a message is being
        sent, the generator is suspended at a yield and would keep its blocks until closed."""


class TextGenerationServicer(generate_pb2_grpc.TextGenerationServicer):
    def __init__(self, engine: Engine, metrics: ServiceMetrics, served_model_name: str | None = None) -> None:
        self.engine = engine
        self.metrics = metrics  # the request metrics are recorded here
        self._served_model_name = served_model_name  # None: from the worker's model path
        # Tokenizing a long prompt takes milliseconds: off the event loop, so that other requests'
        # deltas keep flowing. One thread: the tokenizers library does not promise thread safety (a
        # tokenizer shared between threads has failed with "Already borrowed").
        self._tokenizer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")

    async def _run_tokenizer(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

    def _model_info(self) -> WorkerDescription:
        """The model's limits, known once a worker has connected (before: UNAVAILABLE, as health
        says NOT_SERVING)."""
        model_info = self.engine.model_info
        if model_info is None:
            raise EngineUnavailableError("no worker is ready")
        return model_info

    def served_model_name(self) -> str | None:
        """--served-model-name, else the worker's model folder name or GGUF file stem (None until a
        worker has connected once)."""
        if self._served_model_name:
            return self._served_model_name
        model_info = self.engine.model_info
        return default_served_name(model_info.model_name) if model_info is not None else None

    def _convert(self, request: generate_pb2.GenerateRequest) -> tuple[list[int], SamplingParams]:
        model_info = self._model_info()
        prompt = convert.prompt_token_ids(request, self.engine.tokenizer, model_info)
        return prompt, convert.sampling_params(request, len(prompt), model_info)

    async def Generate(self, request: generate_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> generate_pb2.GenerateResponse:
        request_id = convert.request_id_of(request)
        with RequestRecord(self.metrics, "Generate", request_id, context, self.served_model_name()) as record:
            prompt, params = await self._run_tokenizer(self._convert, request)
            response = ResponseAccumulator(request_id, params.n)
            async with contextlib.aclosing(self.engine.generate(prompt, params)) as outputs:
                async for output in outputs:
                    record.on_output(output)
                    response.add(output)
        return response.result()

    async def GenerateStream(self, request: generate_pb2.GenerateRequest,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[generate_pb2.GenerateStreamResponse]:
        request_id = convert.request_id_of(request)
        with RequestRecord(self.metrics, "GenerateStream", request_id, context,
                          self.served_model_name()) as record:
            prompt, params = await self._run_tokenizer(self._convert, request)
            async with contextlib.aclosing(self.engine.generate(prompt, params)) as outputs:
                async for output in outputs:
                    record.on_output(output)
                    yield stream_response(request_id, output)

    async def Tokenize(self, request: generate_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> generate_pb2.TokenizeResponse:
        tokenizer = self.engine.tokenizer
        kind = request.WhichOneof("input")
        # Text that could not fit the model's context is refused untokenized (once a worker told it).
        model_info = self.engine.model_info
        if tokenizer is None and model_info is None:  # the tokenizer may come with the worker's model
            raise EngineUnavailableError("no worker is ready")
        max_tokens = model_info.max_model_len if model_info is not None else None
        if kind == "text":
            add_special_tokens = request.add_special_tokens if request.HasField("add_special_tokens") else True
            ids = await self._run_tokenizer(convert.encode_text, tokenizer, request.text, add_special_tokens,
                                            max_tokens)
        elif kind == "chat":
            ids = await self._run_tokenizer(convert.encode_chat, tokenizer, request.chat, max_tokens)
        else:
            raise RequestError("input: set one of text or chat")
        return generate_pb2.TokenizeResponse(token_ids=ids)

    async def Detokenize(self, request: generate_pb2.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> generate_pb2.DetokenizeResponse:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            self._model_info()  # no worker yet: UNAVAILABLE (the tokenizer may come with its model)
            raise RequestError("token_ids: this model has no tokenizer")
        ids = list(request.token_ids)
        convert.check_vocabulary(ids, "token_ids", self._model_info().vocab_size)
        text = await self._run_tokenizer(
            lambda: tokenizer.decode(ids, skip_special_tokens=request.skip_special_tokens))
        return generate_pb2.DetokenizeResponse(text=text)

    async def GetModelInfo(self, request: generate_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> generate_pb2.GetModelInfoResponse:
        model_info = self._model_info()
        return model_info_response(model_info, self.engine.tokenizer, self.served_model_name() or "",
                                   has_constraints=self.engine.has_constraints,
                                   max_grammar_compile_ms=self.engine.max_grammar_compile_ms)

    async def GetLoad(self, request: generate_pb2.GetLoadRequest,
                      context: grpc.aio.ServicerContext) -> generate_pb2.GetLoadResponse:
        return load_response(LoadReport.of(self.engine.worker_stats()))

    def close(self) -> None:
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)


class PublicServer:
    """A built, not yet started public server. `port` is the bound port (useful with port 0).

    Health: "", SERVICE_NAME and VLLM_SERVICE_NAME report NOT_SERVING until engine.is_ready, SERVING while it is,
    NOT_SERVING again if it stops being ready, and NOT_SERVING for good once set_not_serving() or
    stop() is called (so load balancers drain the server before it goes away).
    """

    def __init__(self, server: grpc.aio.Server, port: int, engine: Engine, servicer: TextGenerationServicer,
                 health_servicer: health.aio.HealthServicer, readiness_poll_s: float,
                 refused_calls: RefusedCalls | None = None) -> None:
        self.server = server
        self.port = port
        self.engine = engine
        self.servicer = servicer
        self.health = health_servicer
        self.readiness_poll_s = readiness_poll_s
        self.refused_calls = refused_calls  # with API keys: the refusals counted and summarised
        self.vllm: VllmEngineServicer | None = None  # the gateways' dialect on the same port
        self._watch_task: asyncio.Task[None] | None = None
        self._draining = False

    async def start(self) -> None:
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        self._watch_task = asyncio.create_task(self._watch_readiness(), name="health-readiness")
        logger.info("public gRPC server listening on port %d", self.port)

    async def set_not_serving(self) -> None:
        """Reports NOT_SERVING from now on, whatever the engine's state (call when draining)."""
        self._draining = True
        await self.health.enter_graceful_shutdown()

    @property
    def is_serving(self) -> bool:
        """What health reports, as a flag (for the metrics server's HTTP /health): SERVING while the
        engine is ready and the server is not draining."""
        return not self._draining and self.engine.is_ready

    async def stop(self, grace: float | None) -> None:
        """Reports NOT_SERVING, then stops: calls in flight get `grace` seconds to finish."""
        await self.set_not_serving()
        if self._watch_task is not None:
            self._watch_task.cancel()
        await self.server.stop(grace)
        self.servicer.close()
        if self.refused_calls is not None:
            self.refused_calls.flush()

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()

    async def _set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        for service in ("", SERVICE_NAME, VLLM_SERVICE_NAME):
            await self.health.set(service, status)

    async def _watch_readiness(self) -> None:
        # The engine offers a flag, not an event: polling it keeps the engine free of health logic.
        was_ready: bool | None = None
        while True:
            is_ready = self.engine.is_ready
            if is_ready != was_ready:
                serving = health_pb2.HealthCheckResponse.SERVING if is_ready else \
                    health_pb2.HealthCheckResponse.NOT_SERVING
                await self._set_health(serving)
                logger.info("health: %s", health_pb2.HealthCheckResponse.ServingStatus.Name(serving))
                was_ready = is_ready
            await asyncio.sleep(self.readiness_poll_s)


# grpc core cancels calls that wait for the application beyond its pending-request limits (1,000
# soft, 3,000 hard by default) or 30 s: under a burst of calls the clients saw CANCELLED, which only
# a client may cause. Raised far above the server's own admission limit (max_concurrent_calls),
# which answers RESOURCE_EXHAUSTED instead.
PENDING_CALL_OPTIONS = {"grpc.server.max_pending_requests": MAX_PENDING_CALLS,
                        "grpc.server.max_pending_requests_hard_limit": MAX_PENDING_CALLS,
                        "grpc.server_max_unrequested_time_in_server": 3600}


def build_public_server(engine: Engine, host: str, port: int, *,
                        max_message_bytes: int = grpc_options.MAX_MESSAGE_BYTES,
                        readiness_poll_s: float = 0.5, config: PublicServerConfig | None = None,
                        api_keys: ApiKeys | None = None, metrics: ServiceMetrics | None = None,
                        refused_log_interval_s: float = DEFAULT_INTERVAL_S) -> PublicServer:
    """Builds the server and binds host:port (port 0 picks a free one); call `await start()`.

    `config` adds TLS, reflection and the admission limit (its host and port are not used: the
    arguments are); `api_keys` makes every call but health checks need a key (refused calls are
    counted in `metrics` and summarised in one INFO line per refused_log_interval_s). Raises
    PortInUseError when the port is taken. Must run inside the event loop that will serve it
    (grpc.aio binds the server to that loop).
    """
    install_grpc_log_filter()  # no client-sent bytes in grpcio's log records, in-process servers too
    config = config or PublicServerConfig()
    metrics = metrics or ServiceMetrics(recording=False)
    refused_calls = None
    auth: grpc.aio.ServerInterceptor = MetadataCheckInterceptor()
    if api_keys is not None:
        refused_calls = RefusedCalls(metrics, refused_log_interval_s)
        auth = BearerTokenInterceptor(api_keys.accepts, API_KEY_REFUSAL, on_refused=refused_calls)
    server = grpc_options.new_server(STATUSES, auth, max_concurrent_calls=config.max_concurrent_calls,
                                     max_message_bytes=max_message_bytes, options=PENDING_CALL_OPTIONS)
    servicer = TextGenerationServicer(engine, metrics, config.served_model_name)
    generate_pb2_grpc.add_TextGenerationServicer_to_server(servicer, server)
    vllm_servicer = VllmEngineServicer(servicer)
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(vllm_servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if config.reflection:
        reflection.enable_server_reflection([SERVICE_NAME, VLLM_SERVICE_NAME, health.SERVICE_NAME,
                                             reflection.SERVICE_NAME], server,
                                            pool=public_descriptor_pool())
    credentials: Callable[[], grpc.ServerCredentials] | None = None
    if config.tls_cert is not None and config.tls_key is not None:
        # One set of credentials per address bound (a loopback host is bound twice): a function, not an object.
        credentials = ReloadingCertificates(config.tls_cert, config.tls_key, config.tls_client_ca).server_credentials
    bound_port = listen(server, host, port, credentials, PUBLIC_PORT_IN_USE)
    public = PublicServer(server, bound_port, engine, servicer, health_servicer, readiness_poll_s, refused_calls)
    public.vllm = vllm_servicer
    vllm_servicer.is_serving = lambda: public.is_serving  # HealthCheck says what grpc.health.v1 says
    return public
