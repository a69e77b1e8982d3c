"""What a worker serves, as both services hold it: the one Python form of worker.proto's
DescribeResponse, converted to and from the message here and nowhere else."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from common.generated.nanovllm.worker.v1 import worker_pb2


@dataclass(frozen=True)
class WorkerDescription:
    """A worker's model, cache geometry and step limits (its Describe reply). The scheduler narrows it
    to what a lane serves: max_model_len within its own limit and the KV pool, the EOS ids with the
    tokenizer's, num_kv_blocks as claimed by InitCache."""

    model_name: str
    dtype: str
    block_size: int
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int  # blocks that fit in the worker's KV budget (or, once claimed, the pool's)
    device: str
    tensor_parallel_size: int = 1
    eos_token_ids: tuple[int, ...] = ()
    max_num_seqs: int = 0  # 0: the worker sets no limit of its own
    max_num_batched_tokens: int = 0
    num_held_sequences: int = 0  # sequences it holds state for right now

    @classmethod
    def from_proto(cls, message: worker_pb2.DescribeResponse) -> WorkerDescription:
        values = {f.name: getattr(message, f.name) for f in dataclasses.fields(cls)}
        return cls(**{**values, "eos_token_ids": tuple(message.eos_token_ids)})

    def to_proto(self) -> worker_pb2.DescribeResponse:
        return worker_pb2.DescribeResponse(**dataclasses.asdict(self))
