"""The offline LLM's n samples: each prompt answers sample 0 in its top-level fields and every sample
in "samples"; sample 0 is the n = 1 request with the same seed, the others differ, and a run repeats."""
from __future__ import annotations

import pytest

from common import SamplingParams
from offline import LLM
from tests.tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory):
    model = make_tiny_checkpoint(tmp_path_factory.mktemp("samples"), "qwen3")
    engine = LLM(str(model), block_size=16, num_kv_blocks=128, device="cpu")
    yield engine
    engine.close()


def test_n_samples_offline(llm: LLM) -> None:
    prompts = [[5, 6, 7, 8] * 9, [9, 10, 11]]
    params = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=12, ignore_eos=True)
    first, second = llm.generate(prompts, params, use_tqdm=False)
    for result, prompt in ((first, prompts[0]), (second, prompts[1])):
        samples = result["samples"]
        assert [len(s["token_ids"]) for s in samples] == [12, 12, 12]
        assert result["token_ids"] == samples[0]["token_ids"]
        assert len({tuple(s["token_ids"]) for s in samples}) == 3
        (alone,) = llm.generate([prompt], SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
                                use_tqdm=False)
        assert alone["token_ids"] == samples[0]["token_ids"] and "samples" not in alone
    assert llm.generate(prompts, params, use_tqdm=False) == [first, second]
