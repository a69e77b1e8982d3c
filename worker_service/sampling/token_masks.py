"""Token masks of structured output: the tokens a constrained sequence may sample in one step.

The scheduler sends a TokenMask in whichever form is smallest; the worker decodes each into one
packed form, allowed bits LSB first (bit t is byte t // 8, bit t % 8, as the proto's bitmask), so
that masks cross to the device as ceil(vocab / 8) bytes a row and are unpacked there, for any
range of columns (a tensor-parallel rank's slice of the vocabulary).
"""
from __future__ import annotations

import numpy as np
import torch

from common.generated.nanovllm.worker.v1 import worker_pb2


def num_mask_bytes(vocab_size: int) -> int:
    return (vocab_size + 7) // 8


def decode_token_mask(mask: worker_pb2.TokenMask, vocab_size: int) -> np.ndarray:
    """The allowed tokens of `mask` as packed bits ([num_mask_bytes] uint8; bits past the vocabulary
    clear). Raises ValueError naming the field when the mask is malformed: no form, a bitmask empty or
    longer than the vocabulary, an id outside [0, vocab_size), or no allowed token."""
    form = mask.WhichOneof("form")
    num_bytes = num_mask_bytes(vocab_size)
    if form is None:
        raise ValueError("token_mask: no form set (allowed_bitmask, allowed_ids or forbidden_ids)")
    if form == "allowed_bitmask":
        num_sent = len(mask.allowed_bitmask)
        if not 1 <= num_sent <= num_bytes:
            raise ValueError(f"token_mask.allowed_bitmask: must be 1..{num_bytes} bytes for a vocabulary of "
                             f"{vocab_size}, got {num_sent}")
        bits = np.zeros(num_bytes, dtype=np.uint8)  # the tokens past a shorter bitmask's end are forbidden
        bits[:num_sent] = np.frombuffer(mask.allowed_bitmask, dtype=np.uint8)
        if vocab_size % 8:  # the last byte's bits past the vocabulary are padding: never a token
            bits[-1] &= (1 << (vocab_size % 8)) - 1
    else:
        listed = getattr(mask, form).ids
        ids = np.fromiter(listed, dtype=np.int64, count=len(listed))
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            bad = ids[(ids < 0) | (ids >= vocab_size)][0]
            raise ValueError(f"token_mask.{form}: ids must be in [0, {vocab_size}), got {bad}")
        is_allowed_list = form == "allowed_ids"
        allowed = np.full(vocab_size, not is_allowed_list, dtype=bool)
        allowed[ids] = is_allowed_list
        bits = np.packbits(allowed, bitorder="little")
    if not bits.any():
        raise ValueError(f"token_mask.{form}: allows no token")
    return bits


def is_allowed(bits: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
    """Whether each of token_ids (int64, in the vocabulary) is allowed by packed bits."""
    return ((bits[token_ids >> 3] >> (token_ids & 7).astype(np.uint8)) & 1).astype(bool)


def unpack_columns(packed: torch.Tensor, start: int, width: int) -> torch.Tensor:
    """Columns [start, start + width) of packed rows ([R, num_mask_bytes] uint8, on the device) as
    a [R, width] bool tensor, unpacked on the device: only the bytes that hold those columns."""
    first, end = start // 8, (start + width + 7) // 8
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed[:, first:end, None] >> shifts).bitwise_and_(1)  # [R, bytes, 8], LSB first
    offset = start - 8 * first
    return bits.view(packed.shape[0], -1)[:, offset:offset + width].bool()
