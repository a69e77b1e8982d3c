"""The fused sampling kernel's paths under token masks, logit_bias and the min_tokens ban: the edits
are applied to the logits first, so the fused kernel (whole rows, and each rank's slice) draws the
token it would draw from the edited logits, always an allowed one.

Runs on a CUDA device, or on the CPU through Triton's interpreter (see test_fused_sampling.py)."""
from __future__ import annotations

import random

import pytest
import torch

from tests.worker_service.triton_runtime import DEVICE, INTERPRET, skip_module_unless_kernels_run

skip_module_unless_kernels_run()

from common.contract.sampling_params import SamplingParams  # noqa: E402
from tests.worker_service.test_logit_edits import allowed_ids, bitmask, build, forbidden_ids, slice_tokens  # noqa: E402
from worker_service.sampling.fused_sampling import gumbel_sample  # noqa: E402
from worker_service.sampling.sampler import Sampler  # noqa: E402
from worker_service.sampling.sampling_state import SamplingBatch  # noqa: E402

pytestmark = pytest.mark.gpu

P = SamplingParams
VOCAB_SIZE = 300


def fused_sampler(seed: int) -> Sampler:
    return Sampler(seed=seed, fused=True if INTERPRET else None)


def edited_batch() -> SamplingBatch:
    """Plain temperature rows (and a greedy one) with a mask, a bias, a ban, a mask and a bias."""
    params = [P(temperature=0.8), P(temperature=0.0, logit_bias=[(17, 100.0)]), P(temperature=1.5, min_tokens=2),
              P(temperature=1.0, logit_bias=[(200, 3.0)])]
    masks = [allowed_ids(3, 150, 299), None, forbidden_ids(*range(0, VOCAB_SIZE, 2)),
             bitmask([199, 200, 201], VOCAB_SIZE)]
    return build(params, VOCAB_SIZE, DEVICE, masks=masks, banned=[[], [], [1, 3, 5], []])


def reference_logits(logits: torch.Tensor) -> torch.Tensor:
    """edited_batch's edits written out by hand."""
    ref = logits.float().clone()
    keep0 = torch.full((VOCAB_SIZE,), float("-inf"), device=DEVICE)
    keep0[[3, 150, 299]] = 0.0
    ref[0] += keep0
    ref[1, 17] += 100.0
    ref[2, 0::2] = float("-inf")
    ref[2, [1, 3, 5]] = float("-inf")
    ref[3, 200] += 3.0
    keep3 = torch.full((VOCAB_SIZE,), float("-inf"), device=DEVICE)
    keep3[[199, 200, 201]] = 0.0
    ref[3] += keep3
    return ref


def test_the_fused_path_samples_from_the_edited_logits() -> None:
    batch = edited_batch()
    assert batch.is_plain_temperature
    logits = torch.randn(4, VOCAB_SIZE, generator=torch.Generator().manual_seed(5)).to(DEVICE, torch.bfloat16)
    reference = reference_logits(logits)
    sampler, seeds = fused_sampler(seed=9), random.Random(9)
    for _ in range(small_count()):
        tokens = sampler.sample(logits, batch).token_ids
        assert torch.equal(tokens, gumbel_sample(reference, batch.inv_temperatures, seeds.getrandbits(62)))
        assert tokens[0] in (3, 150, 299) and tokens[1] == 17 and tokens[2] % 2 == 1 and tokens[2] > 5
        assert tokens[3] in (199, 200, 201)


@pytest.mark.parametrize("bounds", [[0, 150, 300], [0, 100, 200, 300]])
def test_slices_sample_the_whole_rows_tokens(bounds: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensor parallelism's fused path: every rank edits its own columns (padding never read), and the
    best of the slices' bests is the token of the whole rows (every rank's sampler draws the same seed)."""
    batch = edited_batch()
    logits = torch.randn(4, VOCAB_SIZE, generator=torch.Generator().manual_seed(6)).to(DEVICE, torch.bfloat16)
    expected = fused_sampler(seed=4).sample(logits, batch).token_ids
    tokens = slice_tokens(lambda: fused_sampler(seed=4), logits.float(), batch, bounds, 5, monkeypatch)
    assert torch.equal(tokens, expected)


def small_count() -> int:
    return 3 if INTERPRET else 50
