"""Turns the scheduler's decisions into the step sent to the worker: the Step message (only deltas) and
what its reply is read back against. The one place that builds a StepRequest."""
from __future__ import annotations

from dataclasses import dataclass

from common.generated.nanovllm.worker.v1 import worker_pb2
from scheduler_service.core.scheduler import SchedulerOutput
from scheduler_service.core.sequence import ScheduledSequence, Sequence


@dataclass
class InFlightStep:
    """A step sent to the worker whose reply has not been processed yet."""

    step_id: int
    request: worker_pb2.StepRequest
    # For each sequence the step computes: the sequence and its preemption count at the time, so
    # that a token for a sequence preempted since is recognised and dropped.
    scheduled: dict[int, tuple[Sequence, int]]
    # Tokens the worker computes for it (prefill chunks and decode iterations): sizes its deadline.
    num_tokens: int = 0
    # Its decode iterations when it runs decodes alone (0 when it prefills): its period is timed.
    num_decode_steps: int = 0


def build_step(step_id: int, output: SchedulerOutput, eos_token_ids: frozenset[int] = frozenset()) -> InFlightStep:
    """The step for the scheduler's output: its message, and its sequences with their epochs.
    eos_token_ids: what min_tokens holds back, with each request's stop token ids."""
    scheduled = {}
    num_tokens = 0  # decode iterations included
    decodes_only = True
    for item in output.scheduled:
        seq = item.seq
        scheduled[seq.seq_id] = (seq, seq.num_preemptions)
        num_tokens += item.num_tokens
        decodes_only = decodes_only and item.num_tokens == item.num_samples
    num_decode_steps = output.num_decode_steps if decodes_only and output.scheduled else 0
    request = build_step_request(step_id, output, eos_token_ids)
    return InFlightStep(step_id, request, scheduled, num_tokens, num_decode_steps)


def build_step_request(step_id: int, output: SchedulerOutput,
                       eos_token_ids: frozenset[int] = frozenset()) -> worker_pb2.StepRequest:
    """A pure function of the scheduler's output: it changes no sequence."""
    request = worker_pb2.StepRequest(step_id=step_id, released_seq_ids=output.released_seq_ids,
                                     num_decode_steps=output.num_decode_steps)
    add_running = request.running_sequences.add
    with_grammars = output.has_constraints and output.grammars_on_worker
    for item in output.scheduled:
        if item.is_new_on_worker:
            request.new_sequences.append(_new_sequence(item, eos_token_ids, with_grammars))
        elif item.new_block_ids or item.token_ids:
            add_running(seq_id=item.seq.seq_id, new_block_ids=item.new_block_ids, token_ids=item.token_ids)
        else:
            add_running(seq_id=item.seq.seq_id)  # a decode in its blocks: the common case, built 3x faster
    if output.has_constraints and not output.grammars_on_worker:  # a pass of its own: free text pays nothing per row
        _add_token_masks(request, output.scheduled)
    return request


def _add_token_masks(request: worker_pb2.StepRequest, scheduled: list[ScheduledSequence]) -> None:
    """The token mask of each constrained sequence that samples in this step (its matcher has consumed
    every token it holds: the scheduler schedules none with a token pending)."""
    seq_id_to_seq = {item.seq.seq_id: item.seq for item in scheduled
                     if item.num_samples and item.seq.constraint_state is not None}
    if not seq_id_to_seq:
        return
    for message in (*request.new_sequences, *request.running_sequences):
        seq = seq_id_to_seq.get(message.seq_id)
        if seq is not None:
            seq.constraint_state.write_mask(seq, message.token_mask)  # type: ignore[union-attr]


def _new_sequence(item: ScheduledSequence, eos_token_ids: frozenset[int], with_grammar: bool) -> worker_pb2.NewSequence:
    """with_grammar: a constrained sequence comes with its grammar and every output token it holds (its
    matcher has consumed exactly those), from which the worker's own matcher starts."""
    seq = item.seq
    params = seq.sampling_params
    message = worker_pb2.NewSequence(
        seq_id=seq.seq_id,
        token_ids=item.token_ids,
        num_computed_tokens=item.start_position,
        num_tokens=seq.num_tokens,
        num_prompt_tokens=seq.num_prompt_tokens,
        block_table=item.new_block_ids,
        sampling=params.to_proto(),
    )
    if params.needs_token_history and item.start_position:
        message.cached_token_ids.extend(seq.token_ids[:item.start_position])
    if params.min_tokens:
        banned = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_token_ids)
        message.sampling.min_tokens_banned_ids.extend(sorted(banned))
    if with_grammar and seq.constraint_state is not None:
        message.grammar.grammar = seq.constraint_state.grammar_text
        message.grammar.output_token_ids.extend(seq.output_token_ids)
    return message
