"""Turns the scheduler's decisions into the Step message that crosses to the worker: only deltas."""
from __future__ import annotations

from common.generated.nanovllm.worker.v1 import worker_pb2
from scheduler_service.scheduler import ScheduledSequence, SchedulerOutput


def build_step_request(step_id: int, output: SchedulerOutput) -> worker_pb2.StepRequest:
    request = worker_pb2.StepRequest(step_id=step_id, released_seq_ids=output.released_seq_ids,
                                     num_decode_steps=output.num_decode_steps)
    for item in output.scheduled:
        if item.is_new_on_worker:
            request.new_sequences.append(_new_sequence(item))
        else:
            request.running_sequences.append(_running_sequence(item))
        item.seq.num_blocks_on_worker = len(item.seq.block_table)
        item.seq.worker_holds_last_token = item.samples
    return request


def _chunk(item: ScheduledSequence) -> list[int]:
    """The tokens to compute; empty for a decode step, whose one token the worker sampled itself
    (with lookahead the scheduler may not even know it yet)."""
    if item.seq.worker_holds_last_token:
        return []
    return item.seq.token_ids[item.start_position:item.start_position + item.num_tokens]


def _new_sequence(item: ScheduledSequence) -> worker_pb2.NewSequence:
    seq = item.seq
    params = seq.sampling_params
    message = worker_pb2.NewSequence(
        seq_id=seq.seq_id,
        token_ids=seq.token_ids[item.start_position:item.start_position + item.num_tokens],
        num_computed_tokens=item.start_position,
        num_tokens=seq.num_tokens,
        num_prompt_tokens=seq.num_prompt_tokens,
        block_table=seq.block_table,
        sampling=params.to_proto(),
    )
    if params.needs_token_history and item.start_position:
        message.cached_token_ids.extend(seq.token_ids[:item.start_position])
    return message


def _running_sequence(item: ScheduledSequence) -> worker_pb2.RunningSequence:
    seq = item.seq
    return worker_pb2.RunningSequence(
        seq_id=seq.seq_id,
        new_block_ids=seq.block_table[seq.num_blocks_on_worker:],
        token_ids=_chunk(item),
    )
