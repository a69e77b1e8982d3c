"""Batched sampling: penalties, logit bias, the min_tokens ban, token masks, greedy argmax,
temperature, top-k, top-p, min-p, seeded or unseeded sampling, and log-probabilities, each row with
its own parameters (see `SamplingBatch`).

Every op runs on the device with no host-device synchronisation. Sampling uses the exponential
race: argmax(p / q) with q ~ Exp(1) i.i.d. picks token i with probability p_i / sum(p), so no
cumulative search (and no renormalisation after filtering) is needed.

Batches that sample by temperature alone (`SamplingBatch.is_plain_temperature`, some row not greedy)
take a shortcut on CUDA: one fused Triton kernel (`fused_sampling.gumbel_sample`, the same race in
log space: argmax(logits / T + Gumbel noise)) reads the logits once, instead of the several [B, V]
passes below. Its noise is counter-based, from a seed the sampler draws on the host for each call.
Seeded rows never take it, so their tokens stay those of `seeded_exponential_noise`. Logit edits
(bias, ban, masks: logit_edits.py) are applied to the logits before either path, so every path
(greedy, filtered, seeded, fused, and each rank's slice) samples only allowed tokens.

Under tensor parallelism greedy and plain-temperature batches sample from each rank's slice of the
logits (`sample_slices`, vocab_parallel.py); others from the gathered logits (`sample`).
"""
from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from worker_service.sampling import FUSED_SAMPLING_DTYPES
from worker_service.sampling.sampling_state import SamplingBatch
from worker_service.sampling.vocab_parallel import VocabSlice, argmax_of_slice, best_of_slices

# Exp(1) draws can be exactly 0 (a uniform draw of 1); p / 0 would beat every real candidate, and
# 0 / 0 = NaN would let argmax pick a filtered token.
_MIN_NOISE = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class SamplerOutput:
    """One sampled token per row, with log-probabilities when any row asked for them.

    Log-probabilities are those of the raw model logits (before penalties, logit bias, bans,
    token masks, temperature and filtering). top_* hold max_num_top_logprobs columns for every row, sorted by decreasing
    logprob; rows that asked for fewer (or none) use a prefix (or ignore them).
    """

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] float32
    top_token_ids: torch.Tensor | None = None  # [B, K] int64
    top_logprobs: torch.Tensor | None = None  # [B, K] float32

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        return self.token_ids, self.logprobs, self.top_token_ids, self.top_logprobs

    def map(self, function: Callable[[torch.Tensor], torch.Tensor]) -> SamplerOutput:
        """The output with function applied to each tensor it holds."""
        return SamplerOutput(*(None if tensor is None else function(tensor) for tensor in self.tensors()))


def stack_iterations(outputs: list[SamplerOutput]) -> SamplerOutput:
    """The outputs of one step's iterations as one, [B] -> [B, num_decode_steps] (top: [B, .., K]);
    a single iteration is a view, not a copy."""
    if len(outputs) == 1:
        return outputs[0].map(lambda tensor: tensor.unsqueeze(1))
    columns = zip(*(output.tensors() for output in outputs), strict=True)
    return SamplerOutput(*(None if values[0] is None else torch.stack(values, dim=1) for values in columns))


class Sampler:
    """Samples one token per row of a [B, V] logits tensor, following each row's parameters.

    `fused` chooses where plain temperature batches take the fused kernel: None (auto) when the
    logits are on CUDA; True also on the CPU through Triton's interpreter (TRITON_INTERPRET=1, for
    tests); False never. The n-th fused call's noise seed is the n-th `getrandbits(62)` of
    `random.Random(seed)`: cheap host work, no device sync. Other calls use torch's generators.
    """

    def __init__(self, seed: int = 0, fused: bool | None = None) -> None:
        self.fused = fused
        self._fused_seeds = random.Random(seed)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Samples from `logits` ([B, V], any float dtype; never modified) with `batch` built for
        the same rows."""
        if logits.dim() != 2 or tuple(logits.shape) != (batch.num_seqs, batch.vocab_size):
            raise ValueError(f"logits of shape {tuple(logits.shape)} for {batch.num_seqs} rows of {batch.vocab_size}")
        if self._takes_fused_path(logits, batch):
            from worker_service.sampling.fused_sampling import gumbel_sample  # imports Triton: only when needed

            seed = self._fused_seeds.getrandbits(62)
            if batch.logit_edits is not None:
                logits = batch.logit_edits.apply(logits)
            return SamplerOutput(token_ids=gumbel_sample(logits, batch.inv_temperatures, seed))
        raw_logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32) if batch.needs_logprobs else None
        penalised = apply_penalties(logits, batch)
        if batch.logit_edits is not None:
            # In place only on a tensor of our own: the caller's logits are never modified.
            logits = batch.logit_edits.apply(penalised, in_place=penalised is not logits)
        else:
            logits = penalised
        if batch.is_all_greedy:
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = _sample_rows(logits, batch)
        return _output(token_ids, raw_logprobs, batch.max_num_top_logprobs)

    def samples_slices(self, batch: SamplingBatch, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether sample_slices takes `batch` with logits of dtype on device: greedy or plain-temperature
        batches (the latter where the fused kernel runs)."""
        return batch.is_plain_temperature and (batch.is_all_greedy or self._can_fuse(dtype, device))

    def sample_slices(self, logits: torch.Tensor, batch: SamplingBatch, vocab_slice: VocabSlice) -> SamplerOutput:
        """Samples from this rank's slice of the vocabulary (tensor parallelism: `logits` [B, columns],
        of which vocab_slice's are real tokens), exchanging each row's best with the other ranks (see
        vocab_parallel): the tokens of sample() on the full logits. A collective: every rank calls it.
        Logit edits apply to this rank's columns of real tokens alone (never to the last rank's padding)."""
        own = vocab_slice.own(logits)
        if batch.logit_edits is not None:
            own = batch.logit_edits.apply(own, vocab_slice.start)
        if batch.is_all_greedy:
            best = argmax_of_slice(own, vocab_slice)
        else:
            from worker_service.sampling.fused_sampling import gumbel_best  # imports Triton: only when needed

            seed = self._fused_seeds.getrandbits(62)
            best = gumbel_best(own, batch.inv_temperatures, seed, vocab_slice.start, vocab_slice.vocab_size)
        return SamplerOutput(token_ids=best_of_slices(*best))

    def _takes_fused_path(self, logits: torch.Tensor, batch: SamplingBatch) -> bool:
        """Whether this call samples with the fused kernel (see the class docstring)."""
        return batch.is_plain_temperature and not batch.is_all_greedy and self._can_fuse(logits.dtype, logits.device)

    def _can_fuse(self, dtype: torch.dtype, device: torch.device) -> bool:
        if self.fused is False or dtype not in FUSED_SAMPLING_DTYPES:
            return False
        if device.type == "cuda":
            return True
        if self.fused and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(f"fused sampling on {device} needs CUDA or TRITON_INTERPRET=1")
        return bool(self.fused)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Returns the logits with the repetition, frequency and presence penalties applied, as a new
    float32 tensor; returns `logits` itself when no row has a penalty."""
    if batch.seen_token_mask is not None:
        logits = logits.float()
        penalty = batch.repetition_penalties[:, None]
        # HF semantics: a seen token's logit moves towards zero (for penalty > 1) on either side.
        penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
        logits = torch.where(batch.seen_token_mask, penalised, logits)
    if batch.output_token_counts is not None:
        counts = batch.output_token_counts
        logits = logits.float() - (
            batch.frequency_penalties[:, None] * counts + batch.presence_penalties[:, None] * (counts > 0)
        )
    return logits


def seeded_exponential_noise(seed: int, vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """Exp(1) noise of shape [vocab_size] (float32) from a generator seeded with `seed` alone.

    On CUDA the generator lives on the device, so the draw is a kernel launch with no host sync and
    no CPU work; on CPU it is torch's CPU generator. The two give different (each reproducible)
    streams, and CUDA's depends on the torch version and GPU model.
    """
    device = torch.device(device)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return torch.empty(vocab_size, dtype=torch.float32, device=device).exponential_(generator=generator)


def _sample_rows(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Samples the non-greedy rows; greedy rows (if any) take the argmax of `logits`."""
    greedy_ids = logits.argmax(dim=-1) if batch.greedy_mask is not None else None
    logits = logits.float() / batch.temperatures[:, None]  # a new tensor: safe to modify in place below
    if batch.top_p is not None:
        logits = _apply_top_k_top_p(logits, batch.top_k, batch.top_p)
    elif batch.top_k is not None:
        logits = _apply_top_k(logits, batch.top_k, batch.max_top_k)
    probs = logits.softmax(dim=-1)
    if batch.min_p is not None:
        probs = _apply_min_p(probs, batch.min_p)
    sampled = probs.div_(_exponential_noise(probs, batch)).argmax(dim=-1)
    if greedy_ids is None:
        return sampled
    return torch.where(batch.greedy_mask, greedy_ids, sampled)


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keeps, in place, the logits at least as large as each row's k-th largest (ties kept, as HF
    does); rows with top_k == vocab_size keep all. Needs only a top-k of max_top_k, not a sort."""
    top_values = logits.topk(max_top_k, dim=-1).values
    kth = top_values.gather(1, (top_k.clamp(max=max_top_k) - 1)[:, None])
    kth = kth.masked_fill(top_k[:, None] >= logits.shape[1], float("-inf"))
    return logits.masked_fill_(logits < kth, float("-inf"))


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p over one descending sort, in place.

    Top-p keeps the smallest prefix of the sorted tokens whose probability (after top-k) reaches
    top_p: a token stays when the mass strictly before it is below top_p, so the first always does.
    Rows without top-p carry top_p = 2, which no mass reaches.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        kth = sorted_logits.gather(1, (top_k - 1)[:, None])
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1).sub_(probs)
    sorted_logits.masked_fill_(mass_before >= top_p[:, None], float("-inf"))
    return logits.scatter_(1, order, sorted_logits)


def _apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zeroes, in place, the probabilities below min_p times the row's largest one."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return probs.masked_fill_(probs < threshold, 0.0)


def _exponential_noise(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Exp(1) noise like `probs`: the global generator for unseeded rows, and for each seeded row a
    generator seeded from (seed, output_index) alone, so its token does not depend on the batch."""
    noise = torch.empty_like(probs).exponential_()
    if batch.seeded_rows:
        seeded = [seeded_exponential_noise(seed, batch.vocab_size, probs.device) for seed in batch.generator_seeds]
        noise.index_copy_(0, batch.seeded_row_index, torch.stack(seeded))
    return noise.clamp_min_(_MIN_NOISE)


def _output(token_ids: torch.Tensor, raw_logprobs: torch.Tensor | None, num_top: int) -> SamplerOutput:
    if raw_logprobs is None:
        return SamplerOutput(token_ids=token_ids)
    logprobs = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1)
    num_top = min(num_top, raw_logprobs.shape[1])
    if num_top == 0:
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)
    top = raw_logprobs.topk(num_top, dim=-1)
    return SamplerOutput(token_ids=token_ids, logprobs=logprobs, top_token_ids=top.indices, top_logprobs=top.values)
