"""The sampling parameters of one step's batch, laid out as device tensors.

`SamplingBatch.build` runs once per step on the host. It looks at the whole batch first so that the
sampler can skip every stage nobody asked for (all greedy: argmax only; no penalties: no [B, V]
penalty tensors; no top-k/top-p/min-p: no sorting; temperature alone: one fused kernel on CUDA),
and it copies each tensor to the device once, from pinned memory and without blocking, so building
a batch never waits for the GPU. Logit edits (logit_bias, min_tokens, token masks) are laid out
here and copied on first use, for the columns that use them (logit_edits.py).
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from common.contract.sampling_params import SamplingParams
from worker_service.sampling.host_copies import host_to_device
from worker_service.sampling.host_copies import to_device as _to_device
from worker_service.sampling.logit_edits import LogitEdits, TokenBias, build_logit_edits

# Odd 64-bit constants (from splitmix64) used to mix (seed, output_index) into one generator seed.
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MIX_1 = 0xBF58476D1CE4E5B9
_MIX_2 = 0x94D049BB133111EB
_MASK_64 = (1 << 64) - 1
_MASK_63 = (1 << 63) - 1
_NEUTRAL = SamplingParams()  # the defaults: what rows without a stage hold


@dataclass(frozen=True)
class SamplingRows:
    """What SamplingBatch.build lays out. Row i samples output token number output_index[i] (0 for
    the first) of a sequence whose prompt and output so far are given; the token lists are read
    only for rows with a penalty (prompt tokens only for the repetition penalty). The last three
    are one per row, or empty for none."""

    params: Sequence[SamplingParams]
    prompt_token_ids: Sequence[Sequence[int] | None]  # None where the worker keeps no history
    output_token_ids: Sequence[Sequence[int]]
    output_index: Sequence[int]
    token_masks: Sequence[np.ndarray | None] = ()  # this step's packed allowed bits (token_masks.py)
    min_tokens_banned_ids: Sequence[Sequence[int]] = ()  # banned while output_index < min_tokens
    logit_biases: Sequence[TokenBias | None] = ()  # params' logit_bias as arrays; empty: made from params

    def __post_init__(self) -> None:
        if not len(self.prompt_token_ids) == len(self.output_token_ids) == len(self.output_index) == len(self.params):
            raise ValueError("params, prompt_token_ids, output_token_ids and output_index differ in length")
        for name in ("token_masks", "min_tokens_banned_ids", "logit_biases"):
            if len(getattr(self, name)) not in (0, len(self.params)):
                raise ValueError(f"{name}: one per row or none")


def generator_seed(seed: int, output_index: int) -> int:
    """The seed of the generator that draws the noise for output token `output_index` of a request
    with `seed`. It depends on nothing else, so a seeded request samples the same n-th token in any
    batch, at any row, and after being recomputed from scratch.

    The result is splitmix64-finalised because torch's CPU generator (mt19937) keeps only the low 32
    bits of its seed: the mixing makes every bit of (seed, output_index) reach those.
    """
    x = (seed + (output_index + 1) * _GOLDEN_GAMMA) & _MASK_64
    x = ((x ^ (x >> 30)) * _MIX_1) & _MASK_64
    x = ((x ^ (x >> 27)) * _MIX_2) & _MASK_64
    return (x ^ (x >> 31)) & _MASK_63


def _scatter_token_rows(
    rows: Sequence[Sequence[Sequence[int]]], vocab_size: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """Occurrences of each token per row as a [B, vocab_size] tensor (for bool: whether it occurs),
    where row i counts the tokens of all the lists in rows[i]. Ids outside the vocabulary are
    dropped (they land in a padding column), as HF's repetition penalty does."""
    lengths = np.fromiter((sum(len(part) for part in parts) for parts in rows), dtype=np.int64, count=len(rows))
    num_tokens = int(lengths.sum())
    counts = torch.zeros(len(rows), vocab_size + 1, dtype=dtype, device=device)
    if num_tokens:
        # np.fromiter over one chained iterator is far cheaper than torch.tensor on a list of ints.
        flat = itertools.chain.from_iterable(itertools.chain.from_iterable(rows))
        indices = np.empty((2, num_tokens), dtype=np.int64)
        indices[0] = np.repeat(np.arange(len(rows), dtype=np.int64), lengths)
        indices[1] = np.fromiter(flat, dtype=np.int64, count=num_tokens)
        row_ids, token_ids = host_to_device(torch.from_numpy(indices), device)
        one = torch.ones((), dtype=dtype, device=device)
        counts.index_put_((row_ids, token_ids.clamp(0, vocab_size)), one, accumulate=dtype != torch.bool)
    return counts[:, :vocab_size]


@dataclass(frozen=True)
class SamplingBatch:
    """Sampling parameters of one step's batch as device tensors, one row per sequence.

    A field is None when no row needs that stage; rows that do not use a stage hold its neutral
    value. Filtering fields (temperature aside) consider only sampled rows, since greedy rows ignore
    them; penalties apply to greedy rows too.
    """

    num_seqs: int
    vocab_size: int
    is_all_greedy: bool
    greedy_mask: torch.Tensor | None  # [B] bool; None when no row, or every row, is greedy
    temperatures: torch.Tensor | None  # [B] float32, 1.0 on greedy rows; None when all greedy
    # No row uses top-k, top-p, min-p, a penalty, a seed or log-probabilities (filters and seeds of
    # greedy rows do not count, as above): rows sample by temperature alone, or are greedy.
    is_plain_temperature: bool
    inv_temperatures: torch.Tensor | None  # [B] float32, 0.0 on greedy rows; only if plain and not all greedy
    top_k: torch.Tensor | None  # [B] int64, vocab_size where unlimited
    max_top_k: int  # the largest limited top_k, 0 if none
    top_p: torch.Tensor | None  # [B] float32, 2.0 (never reached) where unlimited
    min_p: torch.Tensor | None  # [B] float32
    repetition_penalties: torch.Tensor | None  # [B] float32
    seen_token_mask: torch.Tensor | None  # [B, V] bool: token occurs in the prompt or the output
    frequency_penalties: torch.Tensor | None  # [B] float32
    presence_penalties: torch.Tensor | None  # [B] float32
    output_token_counts: torch.Tensor | None  # [B, V] float32: occurrences in the output
    seeded_rows: tuple[int, ...]  # rows sampled with their own generator
    generator_seeds: tuple[int, ...]  # generator_seed(seed, output_index) of each seeded row
    seeded_row_index: torch.Tensor | None  # [S] int64 device copy of seeded_rows
    max_num_top_logprobs: int
    needs_logprobs: bool
    # logit_bias, the min_tokens ban and token masks (logit_edits.py); None when no row has one.
    # They do not make a batch less plain: they are applied before any sampling path.
    logit_edits: LogitEdits | None

    @classmethod
    def build(cls, rows: SamplingRows, vocab_size: int, device: torch.device | str) -> SamplingBatch:
        """Lays out one step's batch (see SamplingRows)."""
        device = torch.device(device)
        params = rows.params
        sampled = [p for p in params if not p.is_greedy]
        is_all_greedy = not sampled
        seeded_rows = tuple(i for i, p in enumerate(params) if not p.is_greedy and p.seed is not None)
        logprob_rows = [p for p in params if p.logprobs]
        # The optional stages, each None when no row uses it.
        top_k = _top_k(params, vocab_size, device)
        top_p = _row_values(params, lambda p: p.top_p if p.top_p < 1.0 else 2.0, lambda p: p.top_p < 1.0, device)
        min_p = _row_values(params, lambda p: p.min_p, lambda p: p.min_p > 0.0, device)
        repetition_penalties, seen_token_mask = _repetition_penalty(rows, vocab_size, device)
        frequency_penalties, presence_penalties, output_token_counts = _output_penalties(rows, vocab_size, device)
        is_plain_temperature = (top_k is None and top_p is None and min_p is None and repetition_penalties is None
                                and frequency_penalties is None and not seeded_rows and not logprob_rows)
        return cls(
            num_seqs=len(params),
            vocab_size=vocab_size,
            is_all_greedy=is_all_greedy,
            greedy_mask=_greedy_mask(params, device),
            temperatures=None if is_all_greedy else _temperatures(params, device),
            is_plain_temperature=is_plain_temperature,
            inv_temperatures=_inv_temperatures(params, device) if is_plain_temperature and not is_all_greedy else None,
            top_k=top_k,
            max_top_k=max((p.top_k for p in sampled if 0 < p.top_k < vocab_size), default=0),
            top_p=top_p,
            min_p=min_p,
            repetition_penalties=repetition_penalties,
            seen_token_mask=seen_token_mask,
            frequency_penalties=frequency_penalties,
            presence_penalties=presence_penalties,
            output_token_counts=output_token_counts,
            seeded_rows=seeded_rows,
            generator_seeds=tuple(generator_seed(params[i].seed, rows.output_index[i]) for i in seeded_rows),
            seeded_row_index=_to_device(seeded_rows, torch.int64, device) if seeded_rows else None,
            max_num_top_logprobs=max((p.num_top_logprobs for p in logprob_rows), default=0),
            needs_logprobs=bool(logprob_rows),
            logit_edits=_logit_edits(rows, vocab_size),
        )


def _logit_edits(rows: SamplingRows, vocab_size: int) -> LogitEdits | None:
    params, num_rows = rows.params, len(rows.params)
    masks = rows.token_masks or [None] * num_rows
    if not any(p.min_tokens or p.logit_bias for p in params) and all(mask is None for mask in masks):
        return None
    banned_ids = rows.min_tokens_banned_ids or [()] * num_rows
    banned = [ids if index < p.min_tokens else ()
              for p, ids, index in zip(params, banned_ids, rows.output_index, strict=True)]
    given = rows.logit_biases or [None] * num_rows
    # A row whose arrays were not made (rows built by hand) makes them here.
    biases = [bias if bias is not None or not p.logit_bias else TokenBias.of(p.logit_bias, vocab_size)
              for p, bias in zip(params, given, strict=True)]
    return build_logit_edits(biases, banned, masks)


def _greedy_mask(params: Sequence[SamplingParams], device: torch.device) -> torch.Tensor | None:
    is_greedy = [p.is_greedy for p in params]
    if all(is_greedy) or not any(is_greedy):
        return None
    return _to_device(is_greedy, torch.bool, device)


def _temperatures(params: Sequence[SamplingParams], device: torch.device) -> torch.Tensor:
    return _to_device([1.0 if p.is_greedy else p.temperature for p in params], torch.float32, device)


def _inv_temperatures(params: Sequence[SamplingParams], device: torch.device) -> torch.Tensor:
    """1 / temperature of each sampled row and 0.0 (greedy) elsewhere, for the fused sampler."""
    return _to_device([0.0 if p.is_greedy else 1.0 / p.temperature for p in params], torch.float32, device)


def _top_k(params: Sequence[SamplingParams], vocab_size: int, device: torch.device) -> torch.Tensor | None:
    values = [p.top_k if p.top_k > 0 and not p.is_greedy and p.top_k < vocab_size else vocab_size for p in params]
    if all(k == vocab_size for k in values):
        return None
    return _to_device(values, torch.int64, device)


def _row_values(
    params: Sequence[SamplingParams],
    value_of: Callable[[SamplingParams], float],
    is_active: Callable[[SamplingParams], bool],
    device: torch.device,
) -> torch.Tensor | None:
    """A [B] float32 tensor of value_of(p) for sampled rows where is_active(p), else of the neutral
    value_of(_NEUTRAL); None when no sampled row is active."""
    active = [not p.is_greedy and is_active(p) for p in params]
    if not any(active):
        return None
    neutral = value_of(_NEUTRAL)
    values = [value_of(p) if a else neutral for p, a in zip(params, active, strict=True)]
    return _to_device(values, torch.float32, device)


def _has_output_penalty(p: SamplingParams) -> bool:
    """Whether the frequency or presence penalty is in use (both count output tokens)."""
    return p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _repetition_penalty(
    rows: SamplingRows, vocab_size: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(repetition_penalties, seen_token_mask), None when no row has the penalty."""
    params = rows.params
    if all(p.repetition_penalty == 1.0 for p in params):
        return None, None
    token_rows: list[tuple[Sequence[int], ...]] = []
    for p, prompt, output in zip(params, rows.prompt_token_ids, rows.output_token_ids, strict=True):
        if p.repetition_penalty == 1.0:
            token_rows.append(())
        elif prompt is None:
            raise ValueError("repetition_penalty needs the prompt token ids")
        else:
            token_rows.append((prompt, output))
    return (_to_device([p.repetition_penalty for p in params], torch.float32, device),
            _scatter_token_rows(token_rows, vocab_size, device, torch.bool))


def _output_penalties(
    rows: SamplingRows, vocab_size: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(frequency_penalties, presence_penalties, output_token_counts), None when no row has either."""
    params = rows.params
    if not any(_has_output_penalty(p) for p in params):
        return None, None, None
    token_rows = [(output,) if _has_output_penalty(p) else ()
                  for p, output in zip(params, rows.output_token_ids, strict=True)]
    return (_to_device([p.frequency_penalty for p in params], torch.float32, device),
            _to_device([p.presence_penalty for p in params], torch.float32, device),
            _scatter_token_rows(token_rows, vocab_size, device, torch.float32))
