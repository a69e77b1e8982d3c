"""Per-row edits of the logits before sampling: logit_bias, the min_tokens ban and token masks.

Applied after the penalties and before temperature and the filters, in that order: biases are
added, then banned and masked-out tokens become -inf, so nothing can bring them back. Sparse edits
(bias and ban, a few ids a row) are one gather and scatter over (row, column) pairs; masks are
packed bits unpacked on the device for the masked rows alone. The host lays everything out once
per batch (`build_logit_edits`); device copies are made per range of columns on first use (the
whole vocabulary, or under tensor parallelism a rank's slice) and reused, pinned and non-blocking.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from worker_service.sampling.host_copies import host_to_device
from worker_service.sampling.token_masks import is_allowed, unpack_columns


@dataclass(frozen=True)
class TokenBias:
    """One sequence's logit_bias as arrays, made once when the worker first sees the sequence."""

    ids: np.ndarray  # [n] int64, distinct
    values: np.ndarray  # [n] float32

    @classmethod
    def of(cls, pairs: Sequence[tuple[int, float]], vocab_size: int) -> TokenBias | None:
        """The bias of (token id, bias) pairs, None when there are none; ValueError naming the field
        for an id outside the vocabulary."""
        if not pairs:
            return None
        ids = np.fromiter((token for token, _ in pairs), dtype=np.int64, count=len(pairs))
        bad = ids[(ids < 0) | (ids >= vocab_size)]
        if bad.size:
            raise ValueError(f"logit_bias: token ids must be in [0, {vocab_size}), got {bad[0]}")
        return cls(ids, np.fromiter((value for _, value in pairs), dtype=np.float32, count=len(pairs)))


@dataclass(frozen=True)
class LogitEdits:
    """A batch's edits on the host: sparse (row, column, value) additions (-inf for a ban) and the
    packed allowed bits of the masked rows."""

    rows: np.ndarray  # [N] int64
    columns: np.ndarray  # [N] int64, distinct per row
    values: np.ndarray  # [N] float32
    mask_rows: np.ndarray  # [R] int64
    mask_bits: np.ndarray  # [R, ceil(vocab / 8)] uint8
    _device: dict = field(default_factory=dict, compare=False, repr=False)  # (device, start, width) -> tensors

    def apply(self, logits: torch.Tensor, start: int = 0, in_place: bool = False) -> torch.Tensor:
        """`logits` ([B, width]: columns [start, start + width) of the vocabulary) with the edits,
        as float32. A new tensor unless in_place and logits are float32 already."""
        sparse, mask = self._on_device(logits.device, start, logits.shape[1])
        if not (in_place and logits.dtype == torch.float32):
            logits = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        if sparse is not None:
            index, values = sparse
            rows, columns = index[0], index[1]
            logits.index_put_((rows, columns), logits[rows, columns] + values)  # distinct pairs: no accumulate
        if mask is not None:
            rows, packed, offset = mask
            allowed = unpack_columns(packed, offset, logits.shape[1])
            logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(~allowed, float("-inf")))
        return logits

    def _on_device(self, device: torch.device, start: int, width: int) -> tuple:
        key = (str(device), start, width)
        if key not in self._device:
            self._device[key] = self._copy(device, start, width)
        return self._device[key]

    def _copy(self, device: torch.device, start: int, width: int) -> tuple:
        sparse = mask = None
        keep = (self.columns >= start) & (self.columns < start + width)
        if keep.any():
            index = np.stack([self.rows[keep], self.columns[keep] - start])
            sparse = (host_to_device(torch.from_numpy(index), device),
                      host_to_device(torch.from_numpy(self.values[keep]), device))
        if self.mask_rows.size:
            first, end = start // 8, (start + width + 7) // 8
            bits = np.ascontiguousarray(self.mask_bits[:, first:end])
            mask = (host_to_device(torch.from_numpy(self.mask_rows), device),
                    host_to_device(torch.from_numpy(bits), device), start - 8 * first)
        return sparse, mask


def build_logit_edits(biases: Sequence[TokenBias | None], banned: Sequence[Sequence[int]],
                      masks: Sequence[np.ndarray | None]) -> LogitEdits | None:
    """The edits of a batch, None when no row has one. Per row: its bias, the ids banned this step
    (min_tokens) and its packed mask. A ban that would leave a masked row no token is dropped: the
    constraint wins (its grammar must be able to end)."""
    rows, columns, values, mask_rows, mask_bits = [], [], [], [], []
    for row, (bias, ban, mask) in enumerate(zip(biases, banned, masks, strict=True)):
        ban_ids = np.unique(np.asarray(ban, dtype=np.int64)) if len(ban) else None
        if mask is not None:
            mask_rows.append(row)
            mask_bits.append(mask)
            if ban_ids is not None and is_allowed(mask, ban_ids).sum() == _num_allowed(mask):
                ban_ids = None
        ids, adds = _row_edits(bias, ban_ids)
        if ids is not None:
            rows.append(np.full(len(ids), row, dtype=np.int64))
            columns.append(ids)
            values.append(adds)
    if not rows and not mask_rows:
        return None
    return LogitEdits(
        rows=np.concatenate(rows) if rows else np.empty(0, dtype=np.int64),
        columns=np.concatenate(columns) if columns else np.empty(0, dtype=np.int64),
        values=np.concatenate(values) if values else np.empty(0, dtype=np.float32),
        mask_rows=np.asarray(mask_rows, dtype=np.int64),
        mask_bits=np.stack(mask_bits) if mask_bits else np.empty((0, 0), dtype=np.uint8))


def _row_edits(bias: TokenBias | None, ban_ids: np.ndarray | None) -> tuple[np.ndarray | None, np.ndarray | None]:
    """One row's (ids, additions), each id once: a banned id adds -inf, whatever its bias."""
    if ban_ids is None:
        return (None, None) if bias is None else (bias.ids, bias.values)
    ban_values = np.full(len(ban_ids), -np.inf, dtype=np.float32)
    if bias is None:
        return ban_ids, ban_values
    unbanned = ~np.isin(bias.ids, ban_ids)
    return (np.concatenate([bias.ids[unbanned], ban_ids]),
            np.concatenate([bias.values[unbanned], ban_values]))


def _num_allowed(bits: np.ndarray) -> int:
    return int(np.unpackbits(bits).sum())  # bits past the vocabulary are clear (decode_token_mask)
