"""A minimal reader of GGUF files (v2 and v3, little-endian): metadata and memory-mapped tensor data,
for the worker's weights and the scheduler's tokenizer (numpy only).

gguf-py's GGUFReader builds numpy views for every element of every metadata array: 3.3 s for the default
model's header on the 2-core machine, against 0.1 s for this reader, which also maps tensor data lazily.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

import numpy as np

QK_K = 256  # elements per K-quant super-block


class GGMLType(IntEnum):
    """GGML tensor type ids (same values as gguf.GGMLQuantizationType)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    BF16 = 30


# type -> (elements per block, bytes per block): the types this project reads
BLOCK_LAYOUTS: dict[int, tuple[int, int]] = {
    GGMLType.F32: (1, 4), GGMLType.F16: (1, 2), GGMLType.BF16: (1, 2),
    GGMLType.Q4_0: (32, 18), GGMLType.Q4_1: (32, 20), GGMLType.Q5_0: (32, 22), GGMLType.Q5_1: (32, 24),
    GGMLType.Q8_0: (32, 34), GGMLType.Q2_K: (QK_K, 84), GGMLType.Q3_K: (QK_K, 110), GGMLType.Q4_K: (QK_K, 144),
    GGMLType.Q5_K: (QK_K, 176), GGMLType.Q6_K: (QK_K, 210), GGMLType.Q8_K: (QK_K, 292),
}  # fmt: skip


def type_name(ggml_type: int) -> str:
    try:
        return GGMLType(ggml_type).name
    except ValueError:
        return f"#{int(ggml_type)}"


def block_layout(ggml_type: int) -> tuple[int, int]:
    """(elements per block, bytes per block) of a supported type."""
    if ggml_type not in BLOCK_LAYOUTS:
        raise NotImplementedError(f"GGML tensor type {type_name(ggml_type)} is not supported")
    return BLOCK_LAYOUTS[ggml_type]


_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# metadata value type id -> struct format of a scalar (8 = string, 9 = array)
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of a GGUF file: ggml_shape is in GGML order (ne0, the contiguous dimension, first)."""

    name: str
    ggml_type: int
    ggml_shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    num_bytes: int | None  # None for a type without a known block layout (BLOCK_LAYOUTS)


class GGUFFile:
    """Parsed header of a GGUF file: `metadata` (key -> value) and `tensors` (name -> info), in file order.

    Scalars become Python values, strings str, numeric arrays numpy arrays and string arrays list[str].
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        # a plain ndarray over the read-only mapping (memmap subclasses would leak into results)
        self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r").view(np.ndarray)
        self._buffer = memoryview(self._mmap)
        self._pos = 0
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, GGUFTensorInfo] = {}
        self._parse()

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes, a read-only uint8 view of the mapped file."""
        info = self.tensors[name]
        if info.num_bytes is None:
            raise NotImplementedError(f"{self.path}: tensor {name} has unsupported GGML type {info.ggml_type}")
        return self._mmap[info.offset : info.offset + info.num_bytes]

    def _parse(self) -> None:
        if bytes(self._buffer[0:4]) != _MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file")
        self._pos = 4
        version = self._scalar("I")
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (big-endian or too old?)")
        num_tensors, num_kvs = self._scalar("Q"), self._scalar("Q")
        for _ in range(num_kvs):
            key = self._string()
            self.metadata[key] = self._value(self._scalar("I"))
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            ggml_shape = tuple(self._scalar("Q") for _ in range(self._scalar("I")))
            infos.append((name, self._scalar("I"), ggml_shape, self._scalar("Q")))
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-self._pos // alignment) * alignment
        for name, ggml_type, ggml_shape, offset in infos:
            start, num_bytes = data_start + offset, None
            if ggml_type in BLOCK_LAYOUTS:
                block_size, type_size = BLOCK_LAYOUTS[ggml_type]
                num_bytes = int(np.prod(ggml_shape, dtype=np.int64)) // block_size * type_size
            if start + (num_bytes or 0) > self._mmap.size:
                raise ValueError(f"{self.path}: tensor {name} runs past the end of the file")
            self.tensors[name] = GGUFTensorInfo(name, ggml_type, ggml_shape, start, num_bytes)

    def _scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self._buffer, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._scalar("Q")
        text = bytes(self._buffer[self._pos : self._pos + length]).decode("utf-8", errors="replace")
        self._pos += length
        return text

    def _value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            item_type, count = self._scalar("I"), self._scalar("Q")
            if item_type in _SCALAR_FORMATS and item_type != 7:
                dtype = np.dtype("<" + _SCALAR_FORMATS[item_type])
                values = np.frombuffer(self._buffer, dtype=dtype, count=count, offset=self._pos).copy()
                self._pos += count * dtype.itemsize
                return values
            return [self._value(item_type) for _ in range(count)]
        if value_type in _SCALAR_FORMATS:
            return self._scalar(_SCALAR_FORMATS[value_type])
        raise ValueError(f"{self.path}: unknown GGUF metadata value type {value_type} at byte {self._pos}")
