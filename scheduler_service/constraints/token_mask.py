"""A sequence's allowed next tokens as the worker receives them (worker_pb2.TokenMask), in whichever
form is smallest on the wire: the allowed ids when few are allowed (a JSON key, a choice), the
forbidden ids when few are forbidden, else the bitmask itself (free text inside a JSON string)."""
from __future__ import annotations

import numpy as np

from common.generated.nanovllm.worker.v1 import worker_pb2


def varint_bytes(value: int) -> int:
    """Bytes of value as a protobuf varint (a packed repeated int32's element)."""
    return max(1, (value.bit_length() + 6) // 7)


def num_allowed(bitmask: np.ndarray) -> int:
    if hasattr(np, "bitwise_count"):  # numpy >= 2: ~2.5 µs for 49k tokens
        return int(np.bitwise_count(bitmask.view(np.uint32)).sum())
    return int.from_bytes(bitmask.tobytes(), "little").bit_count()  # ~6 µs


def write_token_mask(bitmask: np.ndarray, vocab_size: int, mask: worker_pb2.TokenMask,
                     allowed: int | None = None) -> None:
    """Sets mask to the tokens bitmask allows (int32 words, no bit set at or past vocab_size), in the
    smallest form; allowed: their number when the caller counted them already."""
    if allowed is None:
        allowed = num_allowed(bitmask)
    # The bitmask ends with the last word holding an allowed token (the worker forbids the rest):
    # a vocabulary padded past the tokenizer's (Qwen3's 151,936 ids for 49,152 tokens) costs nothing.
    num_words = int(np.flatnonzero(bitmask)[-1]) + 1 if allowed else 1
    num_bytes = min(4 * num_words, (vocab_size + 7) // 8)
    id_bytes = varint_bytes(vocab_size - 1)  # an upper bound per listed id
    if allowed * id_bytes <= num_bytes:
        mask.allowed_ids.ids.extend(np.flatnonzero(_bits(bitmask, vocab_size)).tolist())
    elif (vocab_size - allowed) * id_bytes <= num_bytes:
        mask.forbidden_ids.ids.extend(np.flatnonzero(~_bits(bitmask, vocab_size)).tolist())
    else:
        # Byte t // 8, bit t % 8: llguidance's words in little-endian byte order, trimmed.
        mask.allowed_bitmask = bitmask.astype("<i4", copy=False).view(np.uint8)[:num_bytes].tobytes()


class EncodedMasks:
    """The TokenMasks of the last few distinct bitmasks of one grammar: its sequences meet the same
    states again and again (free text inside a JSON string, after a key), and a copy costs ~3 µs
    where listing ids costs 20-60 µs for 49k tokens. Cleared when full: a few states recur, the
    rest need not be kept."""

    __slots__ = ("max_entries", "_bitmask_to_mask")

    def __init__(self, max_entries: int = 16) -> None:
        self.max_entries = max_entries
        self._bitmask_to_mask: dict[bytes, worker_pb2.TokenMask] = {}

    def write(self, bitmask: np.ndarray, vocab_size: int, mask: worker_pb2.TokenMask) -> None:
        """write_token_mask(bitmask, vocab_size, mask), from the cache when it can."""
        key = bitmask.tobytes()
        encoded = self._bitmask_to_mask.get(key)
        if encoded is None:
            if len(self._bitmask_to_mask) >= self.max_entries:
                self._bitmask_to_mask.clear()
            encoded = self._bitmask_to_mask[key] = worker_pb2.TokenMask()
            write_token_mask(bitmask, vocab_size, encoded)
        mask.CopyFrom(encoded)

    def clear(self) -> None:
        self._bitmask_to_mask.clear()


def allowed_token_ids(mask: worker_pb2.TokenMask, vocab_size: int) -> np.ndarray:
    """The token ids mask allows, ascending: the inverse of write_token_mask (tests, tools)."""
    form = mask.WhichOneof("form")
    if form == "allowed_ids":
        return np.asarray(sorted(mask.allowed_ids.ids), dtype=np.int64)
    if form == "forbidden_ids":
        allowed = np.ones(vocab_size, dtype=bool)
        allowed[list(mask.forbidden_ids.ids)] = False
        return allowed.nonzero()[0]
    if form == "allowed_bitmask":
        bits = np.unpackbits(np.frombuffer(mask.allowed_bitmask, dtype=np.uint8), bitorder="little")
        return bits[:vocab_size].nonzero()[0]
    raise ValueError("token_mask: no form is set")


def _bits(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """One bool per token. As bools, not the uint8 that unpackbits gives: numpy finds the nonzero
    elements of a 49k-token mask in ~6 µs as bools, ~80 µs as uint8."""
    return np.unpackbits(bitmask.astype("<i4", copy=False).view(np.uint8), bitorder="little",
                         count=vocab_size).view(bool)
