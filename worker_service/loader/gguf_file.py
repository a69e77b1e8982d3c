"""A minimal reader of GGUF files (v2 and v3, little-endian): metadata and memory-mapped tensor data.

gguf-py's GGUFReader builds numpy views for every element of every metadata array, which takes seconds on a
49k-token vocabulary; this reader decodes the header in tens of milliseconds and maps tensor data lazily.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from worker_service.loader.gguf_dequant import SUPPORTED_TYPES, block_layout, dequantize

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
    num_bytes: int | None  # None when the type is one this package cannot decode


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

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as a new float32 array of row-major shape."""
        info = self.tensors[name]
        return dequantize(self.raw(name), info.ggml_type, info.ggml_shape)

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
            if ggml_type in SUPPORTED_TYPES:
                block_size, type_size = block_layout(ggml_type)
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
