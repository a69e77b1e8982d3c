"""A Step's deltas applied to the worker's per-sequence state (sequences released, added, their blocks
and chunks), and the list of what the step computes, in order; the one place that reads a Step's
sequences (WorkerCore.launch calls it under its lock)."""
from __future__ import annotations

from common.generated.nanovllm.worker.v1 import worker_pb2
from worker_service.runtime.batch import ScheduledChunk
from worker_service.runtime.sequence_state import WorkerSequence
from worker_service.sampling.grammar_matchers import WorkerGrammars
from worker_service.sampling.token_masks import decode_token_mask


def apply_step(request: worker_pb2.StepRequest, seq_id_to_state: dict[int, WorkerSequence],
               vocab_size: int, grammars: WorkerGrammars | None = None) -> list[ScheduledChunk]:
    """Updates per-sequence state from the step's deltas and lists what to compute, in order; grammars:
    the session's, for new sequences that come with one."""
    for seq_id in request.released_seq_ids:
        seq_id_to_state.pop(seq_id, None)
    chunks: list[ScheduledChunk] = []
    for new in request.new_sequences:
        if new.seq_id in seq_id_to_state:
            raise ValueError(f"sequence {new.seq_id} is already held; release it first")
        state = seq_id_to_state[new.seq_id] = WorkerSequence.from_message(new, vocab_size, grammars)
        token_ids = list(new.token_ids)
        chunks.append(ScheduledChunk(state, token_ids, samples=state.take_chunk(token_ids)))
        _take_mask(chunks[-1], new, request, vocab_size)
    for running in request.running_sequences:
        state = seq_id_to_state.get(running.seq_id)
        if state is None:
            raise ValueError(f"sequence {running.seq_id} is unknown to this worker")
        state.add_blocks(running.new_block_ids)
        if running.token_ids:
            token_ids = list(running.token_ids)
            chunks.append(ScheduledChunk(state, token_ids, samples=state.take_chunk(token_ids, can_grow=True)))
        elif state.pending is not None:
            chunks.append(ScheduledChunk(state, [0], samples=True, token_source=state.pending))
        elif state.last_token is not None:
            chunks.append(ScheduledChunk(state, [state.last_token], samples=True))
        else:
            raise ValueError(f"sequence {running.seq_id}: no tokens to compute and no sampled token")
        _take_mask(chunks[-1], running, request, vocab_size)
    return chunks


def _take_mask(chunk: ScheduledChunk, message: worker_pb2.NewSequence | worker_pb2.RunningSequence,
               request: worker_pb2.StepRequest, vocab_size: int) -> None:
    """Decodes the message's token mask onto its chunk; a chunk that samples nothing ignores it. A
    sequence under a grammar takes no mask: the worker computes its own, at every iteration."""
    if chunk.state.grammar is not None and message.HasField("token_mask"):
        raise ValueError(f"sequence {message.seq_id}: token_mask: not allowed for a sequence with a grammar")
    if not message.HasField("token_mask") or not chunk.samples:
        return
    if request.num_decode_steps > 1:
        raise ValueError(f"sequence {message.seq_id}: token_mask: not allowed with num_decode_steps "
                         f"{request.num_decode_steps} (each iteration would need its own mask)")
    try:
        chunk.token_mask = decode_token_mask(message.token_mask, vocab_size)
    except ValueError as error:
        raise ValueError(f"sequence {message.seq_id}: {error}") from None
