"""Vectorised dequantization of GGML tensor data (the block formats of llama.cpp's ggml-quants) to float32.

Each block kernel takes a (num_blocks, type_size) uint8 array and writes a (num_blocks, block_size) float32
array. The float32 operations follow the order of ggml's reference dequantizers (e.g. `(d * sc) * q - dmin * m`)
so results are bit-identical to them. Large tensors are cut into chunks that fit in cache and spread over a
few threads (numpy releases the GIL inside its loops).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from common.formats.gguf_file import GGMLType, GGUFFile, block_layout, type_name

_CHUNK_ELEMENTS = 1 << 18  # output elements per work item: 1 MiB of float32, fits in L2 with temporaries
_MAX_THREADS = 8


BlockKernel = Callable[[np.ndarray, np.ndarray], None]


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of every block, as a (num_blocks, 1) float32 column."""
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles_into(qs: np.ndarray, out: np.ndarray) -> None:
    """Low nibbles of qs (n, m) into out[:, 0], high nibbles into out[:, 1] (out is (n, 2, m))."""
    np.bitwise_and(qs, 0x0F, out=out[:, 0], casting="unsafe")
    np.right_shift(qs, 4, out=out[:, 1], casting="unsafe")


def _high_bits(qh: np.ndarray, num_bits: int) -> np.ndarray:
    """Bit b of every byte of qh (n, m) as a uint8 (n, num_bits, m) array."""
    shifts = np.arange(num_bits, dtype=np.uint8).reshape(1, num_bits, 1)
    return (qh[:, None, :] >> shifts) & np.uint8(1)


def _q4_0(blocks: np.ndarray, out: np.ndarray) -> None:
    q = out.reshape(-1, 2, 16)
    _nibbles_into(blocks[:, 2:18], q)
    out -= 8.0
    out *= _f16(blocks, 0)


def _q4_1(blocks: np.ndarray, out: np.ndarray) -> None:
    _nibbles_into(blocks[:, 4:20], out.reshape(-1, 2, 16))
    out *= _f16(blocks, 0)
    out += _f16(blocks, 2)


def _q5_into(qh_bytes: np.ndarray, qs: np.ndarray, out: np.ndarray) -> None:
    """5-bit quants: nibbles of qs plus bit j of the little-endian 32-bit qh for element j."""
    high = _high_bits(qh_bytes, 8).transpose(0, 2, 1).reshape(-1, 32)  # element 8 * byte + bit
    lows = np.empty((qs.shape[0], 2, 16), dtype=np.uint8)
    _nibbles_into(qs, lows)
    np.bitwise_or(lows.reshape(-1, 32), high << np.uint8(4), out=out, casting="unsafe")


def _q5_0(blocks: np.ndarray, out: np.ndarray) -> None:
    _q5_into(blocks[:, 2:6], blocks[:, 6:22], out)
    out -= 16.0
    out *= _f16(blocks, 0)


def _q5_1(blocks: np.ndarray, out: np.ndarray) -> None:
    _q5_into(blocks[:, 4:8], blocks[:, 8:24], out)
    out *= _f16(blocks, 0)
    out += _f16(blocks, 2)


def _q8_0(blocks: np.ndarray, out: np.ndarray) -> None:
    np.multiply(blocks[:, 2:34].view(np.int8), _f16(blocks, 0), out=out)


def _q8_k(blocks: np.ndarray, out: np.ndarray) -> None:
    d = blocks[:, 0:4].copy().view(np.float32)
    np.multiply(blocks[:, 4:260].view(np.int8), d, out=out)


def _q2_k(blocks: np.ndarray, out: np.ndarray) -> None:
    scales, qs = blocks[:, 0:16], blocks[:, 16:80]
    dl = _f16(blocks, 80) * (scales & np.uint8(0x0F))
    ml = _f16(blocks, 82) * (scales >> np.uint8(4))
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = out.reshape(-1, 2, 4, 32)  # (half, shift, position)
    np.bitwise_and(qs.reshape(-1, 2, 1, 32) >> shifts, 3, out=q, casting="unsafe")
    groups = out.reshape(-1, 16, 16)  # scales apply to 16 consecutive outputs
    groups *= dl[:, :, None]
    groups -= ml[:, :, None]


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """16 signed 6-bit scales: low nibbles from bytes 0..7, high 2-bit pairs from bytes 8..11."""
    low = np.concatenate([packed[:, 0:8] & np.uint8(0x0F), packed[:, 0:8] >> np.uint8(4)], axis=1)
    high = (packed[:, None, 8:12] >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)) & np.uint8(3)
    return (low | (high.reshape(-1, 16) << np.uint8(4))).astype(np.float32) - 32.0


def _q3_k(blocks: np.ndarray, out: np.ndarray) -> None:
    hmask, qs = blocks[:, 0:32], blocks[:, 32:96]
    dl = _f16(blocks, 108) * _q3_k_scales(blocks[:, 96:108])
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    low = (qs.reshape(-1, 2, 1, 32) >> shifts) & np.uint8(3)
    # a clear hmask bit means "subtract 4"; bit (4 * half + shift) of hmask[position]
    minus4 = (_high_bits(hmask, 8) ^ np.uint8(1)) << np.uint8(2)
    np.subtract(low.reshape(-1, 8, 32), minus4, out=out.reshape(-1, 8, 32), casting="unsafe", dtype=np.int8)
    groups = out.reshape(-1, 16, 16)
    groups *= dl[:, :, None]


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit (scale, min) pairs of Q4_K/Q5_K, packed in 12 bytes."""
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([a & np.uint8(0x3F), (c & np.uint8(0x0F)) | ((a >> np.uint8(2)) & np.uint8(0x30))], axis=1)
    mn = np.concatenate([b & np.uint8(0x3F), (c >> np.uint8(4)) | ((b >> np.uint8(2)) & np.uint8(0x30))], axis=1)
    return sc, mn


def _apply_k_scale_min(blocks: np.ndarray, out: np.ndarray) -> None:
    sc, mn = _k_scale_min(blocks[:, 4:16])
    groups = out.reshape(-1, 8, 32)
    groups *= (_f16(blocks, 0) * sc)[:, :, None]
    groups -= (_f16(blocks, 2) * mn)[:, :, None]


def _q4_k(blocks: np.ndarray, out: np.ndarray) -> None:
    qs = blocks[:, 16:144].reshape(-1, 4, 32)
    q = out.reshape(-1, 4, 2, 32)  # sub-block 2j takes the low nibbles of qs[j], 2j+1 the high ones
    np.bitwise_and(qs, 0x0F, out=q[:, :, 0], casting="unsafe")
    np.right_shift(qs, 4, out=q[:, :, 1], casting="unsafe")
    _apply_k_scale_min(blocks, out)


def _q5_k(blocks: np.ndarray, out: np.ndarray) -> None:
    qh, qs = blocks[:, 16:48], blocks[:, 48:176].reshape(-1, 4, 1, 32)
    low = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=2).reshape(-1, 8, 32)
    np.bitwise_or(low, _high_bits(qh, 8) << np.uint8(4), out=out.reshape(-1, 8, 32), casting="unsafe")
    _apply_k_scale_min(blocks, out)


def _q6_k(blocks: np.ndarray, out: np.ndarray) -> None:
    ql, qh = blocks[:, 0:128].reshape(-1, 2, 1, 2, 32), blocks[:, 128:192].reshape(-1, 2, 1, 32)
    # per half of 128: rows k = 0..3 take the low nibbles of ql[0:32], ql[32:64], then the high ones
    low = np.concatenate([ql & np.uint8(0x0F), ql >> np.uint8(4)], axis=2).reshape(-1, 2, 4, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
    np.bitwise_or(low, high << np.uint8(4), out=out.reshape(-1, 2, 4, 32), casting="unsafe")
    out -= 32.0
    d = _f16(blocks, 208) * blocks[:, 192:208].view(np.int8)
    groups = out.reshape(-1, 16, 16)
    groups *= d[:, :, None]


_BLOCK_KERNELS: dict[int, BlockKernel] = {
    GGMLType.Q4_0: _q4_0, GGMLType.Q4_1: _q4_1, GGMLType.Q5_0: _q5_0, GGMLType.Q5_1: _q5_1, GGMLType.Q8_0: _q8_0,
    GGMLType.Q2_K: _q2_k, GGMLType.Q3_K: _q3_k, GGMLType.Q4_K: _q4_k, GGMLType.Q5_K: _q5_k, GGMLType.Q6_K: _q6_k,
    GGMLType.Q8_K: _q8_k,
}
_PLAIN_FORMATS = {GGMLType.F32: np.float32, GGMLType.F16: np.float16}

# what dequantize handles (the test checks it is every type of common.formats.gguf_file.BLOCK_LAYOUTS)
SUPPORTED_TYPES: frozenset[int] = frozenset([*_BLOCK_KERNELS, *_PLAIN_FORMATS, GGMLType.BF16])


def dequantize_tensor(gguf: GGUFFile, name: str) -> np.ndarray:
    """A tensor of the file as a new float32 array of row-major shape."""
    info = gguf.tensors[name]
    return dequantize(gguf.raw(name), info.ggml_type, info.ggml_shape)


def dequantize(data: np.ndarray | bytes | memoryview, ggml_type: int, ggml_shape: Sequence[int]) -> np.ndarray:
    """Dequantizes one tensor's raw data to a new float32 array.

    data: the tensor's bytes (any numpy dtype; only its bytes are read, e.g. GGUFReader's ReaderTensor.data).
    ggml_type: a GGMLType / gguf.GGMLQuantizationType value. ggml_shape: the dimensions in GGML order (ne0
    first, the contiguous one; ReaderTensor.shape). Returns the array in row-major (HF/PyTorch) order, i.e.
    shape tuple(reversed(ggml_shape)).
    """
    shape = tuple(int(n) for n in reversed(ggml_shape))
    num_elements = int(np.prod(shape, dtype=np.int64))
    block_size, type_size = block_layout(ggml_type)
    raw = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
    if num_elements % block_size or raw.size != num_elements // block_size * type_size:
        raise ValueError(
            f"{type_name(ggml_type)} tensor of shape {shape} needs {num_elements // block_size * type_size} "
            f"bytes in blocks of {block_size}, got {raw.size}"
        )
    if ggml_type in _PLAIN_FORMATS:
        return raw.view(_PLAIN_FORMATS[ggml_type]).astype(np.float32).reshape(shape)
    if ggml_type == GGMLType.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32).reshape(shape)
    out = np.empty(num_elements, dtype=np.float32)
    _run_blocks(_BLOCK_KERNELS[ggml_type], raw.reshape(-1, type_size), out.reshape(-1, block_size))
    return out.reshape(shape)


def _run_blocks(kernel: BlockKernel, blocks: np.ndarray, out: np.ndarray) -> None:
    """Runs the kernel over cache-sized chunks of blocks, on several threads when there are many chunks."""
    blocks_per_chunk = max(1, _CHUNK_ELEMENTS // out.shape[1])
    starts = range(0, blocks.shape[0], blocks_per_chunk)

    def run(start: int) -> None:
        stop = start + blocks_per_chunk
        kernel(blocks[start:stop], out[start:stop])

    num_threads = min(len(starts), _MAX_THREADS, os.cpu_count() or 1)
    if num_threads <= 1:
        for start in starts:
            run(start)
        return
    with ThreadPoolExecutor(num_threads) as pool:
        list(pool.map(run, starts))

