"""Parallel samples (SamplingParams.n): one request becomes n sequences of one prompt.

Sample 0 (the leader) prefills the prompt; the others wait until its full blocks are in the prefix
cache (Scheduler._schedule_waiting) and then compute only the prompt's last partial block. Each
sample then runs, stops and is detokenized on its own, with parameters of its own: n=1 and a seed
stream of its own, so that seeded samples differ from each other and each is reproducible.
"""
from __future__ import annotations

import dataclasses

from common.contract.sampling_params import MAX_SEED, SamplingParams

# Odd 64-bit constants: a Weyl step that spreads the sample indices apart, then the splitmix64
# finaliser. Not the constant the worker adds per output token (sampling_state.generator_seed), so that
# a sample's seed is not its leader's seed shifted by a few output tokens: their noise streams would
# then be the same tokens apart.
_SAMPLE_GAMMA = 0xD1B54A32D192ED03
_MIX_1 = 0xBF58476D1CE4E5B9
_MIX_2 = 0x94D049BB133111EB
_MASK_64 = (1 << 64) - 1


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded with `seed`: the seed itself for sample 0, else a
    well-mixed function of (seed, index) in [0, 2^63)."""
    if index == 0:
        return seed
    x = (seed ^ (index * _SAMPLE_GAMMA)) & _MASK_64
    x = ((x ^ (x >> 30)) * _MIX_1) & _MASK_64
    x = ((x ^ (x >> 27)) * _MIX_2) & _MASK_64
    return (x ^ (x >> 31)) % MAX_SEED


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index`'s parameters: n=1 and its own seed (unseeded stays unseeded). Prompt logprobs
    are sample 0's alone: the prompt is the same for all, and asking for them would keep the others
    from the prefix cache."""
    if index == 0:
        return dataclasses.replace(params, n=1)
    seed = None if params.seed is None else sample_seed(params.seed, index)
    return dataclasses.replace(params, n=1, seed=seed, num_prompt_logprobs=None)
