"""vllm.grpc.engine.VllmEngine on the public port: the dialect of the Shepherd Model Gateway (smg)
and llm-d's endpoint picker, beside our own TextGeneration and on the same engine.

Thin, as TextGenerationServicer: convert (request_conversion), one engine call, convert back
(response_conversion); the same interceptors (TLS, API keys, admission limit, status mapping), the same
RequestRecord (metrics, one log line per request) and the same tokenizer thread.

What the gateway expects beyond the proto (read in smg's source, model_gateway/ and crates/grpc_client/):
- It finds a gRPC worker's runtime by calling each runtime's HealthCheck in turn (sglang first:
  ours answers UNIMPLEMENTED) and takes the first that answers OK, so HealthCheck answers OK with
  `healthy` false while no worker is ready rather than failing.
- It registers a worker from GetModelInfo's labels: the model id is served_model_name (else
  model_path), the context length max_context_length; a failed GetModelInfo leaves the worker
  without a model, so it should be added once we are ready. GetServerInfo is optional.
- Its tokenizer comes from a local path (tokenizer_path, else model_path) or, failing that, from the
  GetTokenizer bundle; it tokenizes and applies chat templates itself and sends TokenizedInput.
- It reads Generate streams as delta chunks (it counts and decodes each chunk's token_ids) with a
  cumulative complete (prompt and cached tokens, finish reason, matched stop), and a non-streamed
  call as one complete holding every output id.
- It sends Abort with the request id when its client goes away or it drops a stream, so Abort ends
  the call with an "abort" complete and frees the request's KV blocks at once.
- It polls GetLoads (one SchedulerLoad per data-parallel rank: we report one) unless KV event
  batches carry load records, which ours do not.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from common.contract.sampling_params import SamplingParams
from scheduler_service.api.request_record import RequestRecord
from scheduler_service.api.vllm import request_conversion as convert
from scheduler_service.api.vllm import tokenizer_bundle
from scheduler_service.api.vllm.abort_handles import AbortHandles
from scheduler_service.api.vllm.kv_events import KvEvents
from scheduler_service.api.vllm.response_conversion import (
    GenerateResponses,
    loads_response,
    model_info_response,
    server_info_response,
)
from scheduler_service.core.engine_core import EngineCore
from scheduler_service.core.errors import RequestError
from scheduler_service.observe.load_report import LoadReport

logger = logging.getLogger(__name__)

SERVICE_NAME = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name


def lane_cores(engine: Any) -> list[EngineCore]:
    """The engine's lanes' cores (the prefix cache lives there); none for an engine without lanes."""
    return [lane.core for lane in getattr(engine, "lanes", ())]


class VllmEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    """`text_api`: our TextGenerationServicer, whose tokenizer thread, served name and metrics this shares."""

    def __init__(self, text_api: Any) -> None:
        self.text_api = text_api
        self.engine = text_api.engine
        self.metrics = text_api.metrics
        self.aborts = AbortHandles()
        self.kv_events = KvEvents()
        for core in lane_cores(self.engine):
            core.set_block_listener(self.kv_events)
        self.is_serving: Callable[[], bool] = lambda: self.engine.is_ready  # the public server's, once built
        self.start_time = time.time()
        self.last_receive_timestamp = 0.0

    def _convert(self, request: vllm_engine_pb2.GenerateRequest) -> tuple[list[int], SamplingParams]:
        model_info = self.text_api._model_info()
        convert.check_supported(request)
        prompt = convert.prompt_token_ids(request, self.engine.tokenizer, model_info)
        return prompt, convert.sampling_params(request, len(prompt), model_info)

    async def Generate(self, request: vllm_engine_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[vllm_engine_pb2.GenerateResponse]:
        self.last_receive_timestamp = time.time()
        request_id = convert.request_id_of(request)
        with RequestRecord(self.metrics, "VllmEngine.Generate", request_id, context,
                           self.text_api.served_model_name()) as record:
            prompt, params = await self.text_api._run_tokenizer(self._convert, request)
            samples = [GenerateResponses(request.stream, index, prompt[0]) for index in range(params.n)]
            with self.aborts.track(request_id) as handle:
                async with contextlib.aclosing(self.engine.generate(prompt, params)) as outputs, \
                        contextlib.aclosing(handle.iterate(outputs)) as abortable:
                    try:
                        async for output in abortable:
                            record.on_output(output)
                            for message in samples[output.index].add(output):
                                yield message
                    except RequestError as error:  # a constraint that does not compile, named as this proto does
                        raise RequestError(convert.vllm_field_message(str(error))) from error
                if handle.is_aborted:
                    record.on_output(samples[0].aborted())
                    for sample in samples:
                        if sample.last is None or not sample.last.finished:
                            yield sample.complete("abort")

    async def Abort(self, request: vllm_engine_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> vllm_engine_pb2.AbortResponse:
        num_aborted = self.aborts.abort(list(request.request_ids))
        logger.debug("Abort: %d of %d request ids in progress", num_aborted, len(request.request_ids))
        return vllm_engine_pb2.AbortResponse()

    async def Embed(self, request: vllm_engine_pb2.EmbedRequest,
                    context: grpc.aio.ServicerContext) -> vllm_engine_pb2.EmbedResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Embed: this engine serves generation models only")

    async def HealthCheck(self, request: vllm_engine_pb2.HealthCheckRequest,
                          context: grpc.aio.ServicerContext) -> vllm_engine_pb2.HealthCheckResponse:
        healthy = self.is_serving()
        message = "serving" if healthy else "not serving: no worker is ready, or the service is draining"
        return vllm_engine_pb2.HealthCheckResponse(healthy=healthy, message=message)

    async def GetModelInfo(self, request: vllm_engine_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> vllm_engine_pb2.GetModelInfoResponse:
        return model_info_response(self.text_api._model_info(), self.engine.tokenizer,
                                   self.text_api.served_model_name() or "")

    async def GetServerInfo(self, request: vllm_engine_pb2.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> vllm_engine_pb2.GetServerInfoResponse:
        return server_info_response(LoadReport.of(self.engine.worker_stats()), self.engine.model_info,
                                    not self.is_serving(), self.last_receive_timestamp, self.start_time)

    async def GetLoads(self, request: vllm_engine_pb2.GetLoadsRequest,
                       context: grpc.aio.ServicerContext) -> vllm_engine_pb2.GetLoadsResponse:
        if request.HasField("dp_rank") and request.dp_rank != 0:
            raise RequestError(f"dp_rank: this engine reports one rank (0), got {request.dp_rank}")
        return loads_response(LoadReport.of(self.engine.worker_stats()), self.engine.model_info)

    async def GetTokenizer(self, request: common_pb2.GetTokenizerRequest,
                           context: grpc.aio.ServicerContext) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            model_info = self.text_api._model_info()  # no worker yet: UNAVAILABLE (the tokenizer may come with it)
            raise RequestError(f"tokenizer: the model {model_info.model_name} has no tokenizer to send")
        eos_token_ids = self.engine.model_info.eos_token_ids if self.engine.model_info else ()
        files = await self.text_api._run_tokenizer(tokenizer_bundle.bundle_files, tokenizer, eos_token_ids)
        for data, sha256 in tokenizer_bundle.chunks(tokenizer_bundle.build_bundle(files)):
            yield common_pb2.GetTokenizerChunk(data=data, sha256=sha256)

    async def FlushCache(self, request: common_pb2.FlushCacheRequest,
                         context: grpc.aio.ServicerContext) -> common_pb2.FlushCacheResponse:
        """At once whatever timeout_s says: forgetting cached prefixes is safe with requests in
        flight here (their blocks keep their content, later lookups just miss)."""
        cores = lane_cores(self.engine)
        for core in cores:
            core.reset_prefix_cache()
        return common_pb2.FlushCacheResponse(success=bool(cores),
                                             message=f"flushed the prefix cache of {len(cores)} worker lane(s)")

    async def StartProfile(self, request: common_pb2.StartProfileRequest,
                           context: grpc.aio.ServicerContext) -> common_pb2.ProfileResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "StartProfile: profiling is not offered on this port")

    async def StopProfile(self, request: common_pb2.StopProfileRequest,
                          context: grpc.aio.ServicerContext) -> common_pb2.ProfileResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "StopProfile: profiling is not offered on this port")

    async def SubscribeKvEvents(self, request: common_pb2.SubscribeKvEventsRequest,
                                context: grpc.aio.ServicerContext) -> AsyncIterator[common_pb2.KvEventBatch]:
        model_info = self.engine.model_info
        self.kv_events.block_size = model_info.block_size if model_info else 0
        with self.kv_events.subscription() as batches:
            await context.send_initial_metadata(())  # the gateway's call returns on the headers, before any event
            async with contextlib.aclosing(batches):
                async for batch in batches:
                    yield batch
