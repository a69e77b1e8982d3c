"""Engine outputs and state -> vllm.grpc.engine responses.

Generate's shape is the one the gateway reads (smg's proto_wrapper calls it the vLLM shape, "delta
chunks, cumulative Complete"): with `stream` set, one chunk per engine delta carrying that delta's
token_ids (the gateway counts and detokenizes them), the running counts so far, and its logprobs;
then one `complete` with every output id, the totals, the finish reason as vLLM spells it
("stop", "length", "abort") and the matched stop. Without `stream`, the `complete` alone. With n > 1
samples, each sample's chunks and complete carry its index; prompt logprobs (input_logprobs) come
with sample 0's first chunk and its complete.
"""
from __future__ import annotations

import time
from datetime import UTC, datetime
from importlib import metadata

from smg_grpc_proto.generated import vllm_engine_pb2

from common.contract.worker_description import WorkerDescription
from scheduler_service.core.outputs import RequestOutput
from scheduler_service.core.sequence import FinishReason
from scheduler_service.observe.load_report import LoadReport

FINISH_REASON_TO_VLLM = {
    FinishReason.LENGTH: "length",
    FinishReason.STOP: "stop",
    FinishReason.STOP_SEQUENCE: "stop",
    FinishReason.ABORTED: "abort",
}
SERVER_TYPE = "nanovllm-grpc"


def _version() -> str:
    try:
        return metadata.version("nanovllm-grpc")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def input_logprobs(output: RequestOutput, first_prompt_token: int) -> vllm_engine_pb2.InputLogProbs | None:
    """The prompt tokens' logprobs as vLLM gives them: one entry per prompt token, the first without a value."""
    if output.prompt_logprobs is None:
        return None
    scores = output.prompt_logprobs
    return vllm_engine_pb2.InputLogProbs(
        token_logprobs=[vllm_engine_pb2.InputTokenLogProb(), *(vllm_engine_pb2.InputTokenLogProb(value=lp)
                                                               for _, lp, _ in scores)],
        token_ids=[first_prompt_token, *(token_id for token_id, _, _ in scores)],
        top_logprobs=[vllm_engine_pb2.TopLogProbs(), *(_top(top) for _, _, top in scores)])


def _top(top: list[tuple[int, float]]) -> vllm_engine_pb2.TopLogProbs:
    return vllm_engine_pb2.TopLogProbs(values=[lp for _, lp in top], token_ids=[t for t, _ in top])


def output_logprobs(output: RequestOutput) -> vllm_engine_pb2.OutputLogProbs | None:
    """The delta's logprobs (None when the request asked for none)."""
    if not output.logprobs:
        return None
    tops = output.top_logprobs or [[] for _ in output.logprobs]
    return vllm_engine_pb2.OutputLogProbs(
        token_logprobs=output.logprobs, token_ids=output.token_ids,
        top_logprobs=[_top(top) for top in tops] if output.top_logprobs else [])


class GenerateResponses:
    """Turns one sample's engine deltas into its Generate messages (chunks, then the complete)."""

    def __init__(self, stream: bool, index: int = 0, first_prompt_token: int = 0) -> None:
        self.stream = stream
        self.index = index
        self.first_prompt_token = first_prompt_token
        self.output_ids: list[int] = []
        self.logprobs = vllm_engine_pb2.OutputLogProbs()
        self.has_logprobs = False
        self.input_logprobs: vllm_engine_pb2.InputLogProbs | None = None
        self.last: RequestOutput | None = None

    def add(self, output: RequestOutput) -> list[vllm_engine_pb2.GenerateResponse]:
        """The messages this delta makes: a chunk when streaming and it has tokens, the complete when it is the last."""
        self.last = output
        self.output_ids.extend(output.token_ids)
        logprobs = output_logprobs(output)
        if logprobs is not None:
            self.has_logprobs = True
            self.logprobs.MergeFrom(logprobs)
        prompt_scores = input_logprobs(output, self.first_prompt_token)
        if prompt_scores is not None:
            self.input_logprobs = prompt_scores
        messages = []
        if self.stream and output.token_ids:
            messages.append(vllm_engine_pb2.GenerateResponse(chunk=vllm_engine_pb2.GenerateStreamChunk(
                token_ids=output.token_ids, prompt_tokens=output.num_prompt_tokens,
                completion_tokens=output.num_output_tokens, cached_tokens=output.num_cached_tokens,
                output_logprobs=logprobs, input_logprobs=prompt_scores, index=self.index)))
        if output.finished:
            messages.append(self.complete(FINISH_REASON_TO_VLLM[output.finish_reason or FinishReason.STOP],
                                          output.matched_stop))
        return messages

    def aborted(self) -> RequestOutput:
        """What the engine's last delta would have been had the Abort RPC ended the request: the
        record's final output."""
        last = self.last or RequestOutput(0)
        return RequestOutput(last.seq_id, finished=True, finish_reason=FinishReason.ABORTED,
                             num_prompt_tokens=last.num_prompt_tokens, num_output_tokens=len(self.output_ids),
                             num_cached_tokens=last.num_cached_tokens)

    def complete(self, finish_reason: str, matched_stop: str | int | None = None) -> vllm_engine_pb2.GenerateResponse:
        last = self.last or RequestOutput(0)
        message = vllm_engine_pb2.GenerateComplete(
            output_ids=self.output_ids, finish_reason=finish_reason, prompt_tokens=last.num_prompt_tokens,
            completion_tokens=len(self.output_ids), cached_tokens=last.num_cached_tokens,
            output_logprobs=self.logprobs if self.has_logprobs else None, input_logprobs=self.input_logprobs,
            index=self.index)
        if isinstance(matched_stop, str):
            message.matched_stop_str = matched_stop
        elif isinstance(matched_stop, int):
            message.matched_token_id = matched_stop
        return vllm_engine_pb2.GenerateResponse(complete=message)


def model_info_response(model_info: WorkerDescription, tokenizer: object | None,
                        served_model_name: str) -> vllm_engine_pb2.GetModelInfoResponse:
    """tokenizer_path stays empty: the gateway loads a tokenizer from model_path when it can read it
    (the worker's path, on the gateway's host or not), else from GetTokenizer, which always holds
    the tokenizer this scheduler uses."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return vllm_engine_pb2.GetModelInfoResponse(
        model_path=model_info.model_name, is_generation=True, max_context_length=model_info.max_model_len,
        vocab_size=model_info.vocab_size, supports_vision=False, served_model_name=served_model_name,
        eos_token_ids=sorted(model_info.eos_token_ids), bos_token_id=bos or 0,
        max_req_input_len=model_info.max_model_len - 1)


def server_info_response(report: LoadReport, model_info: WorkerDescription | None, is_paused: bool,
                         last_receive_timestamp: float, start_time: float) -> vllm_engine_pb2.GetServerInfoResponse:
    """One data-parallel rank as the gateway sees it: the lanes are balanced here, not by it."""
    return vllm_engine_pb2.GetServerInfoResponse(
        active_requests=report.num_running + report.num_waiting, is_paused=is_paused,
        last_receive_timestamp=last_receive_timestamp, uptime_seconds=time.time() - start_time,
        server_type=SERVER_TYPE, data_parallel_size=1,
        block_size=model_info.block_size if model_info else 0,
        model_dtype=model_info.dtype if model_info else "",
        max_num_seqs=model_info.max_num_seqs if model_info else 0)


def loads_response(report: LoadReport, model_info: WorkerDescription | None) -> vllm_engine_pb2.GetLoadsResponse:
    """Every lane summed into one SchedulerLoad (dp_rank 0), as GetServerInfo reports one rank."""
    block_size = model_info.block_size if model_info else 0
    num_blocks = sum(stats.num_kv_blocks for _, stats in report.workers)
    num_free = sum(stats.num_free_kv_blocks for _, stats in report.workers)
    queries = sum(stats.num_prefix_query_tokens for _, stats in report.workers)
    hits = sum(stats.num_prefix_hit_tokens for _, stats in report.workers)
    load = vllm_engine_pb2.SchedulerLoad(
        dp_rank=0, num_running_reqs=report.num_running, num_waiting_reqs=report.num_waiting,
        num_total_reqs=report.num_running + report.num_waiting, num_used_tokens=(num_blocks - num_free) * block_size,
        max_total_num_tokens=num_blocks * block_size, token_usage=report.kv_cache_usage,
        cache_hit_rate=hits / queries if queries else 0.0,
        max_running_requests=model_info.max_num_seqs if model_info else 0)
    return vllm_engine_pb2.GetLoadsResponse(timestamp=datetime.now(UTC).isoformat(), version=_version(),
                                            dp_rank_count=1, loads=[load])
