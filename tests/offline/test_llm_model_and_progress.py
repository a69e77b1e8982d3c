"""LLM's model argument (none: the default model; a hub id: its snapshot in the local Hugging Face
cache, never downloaded) and the progress bar's true prefill and decode rates."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

import offline.llm as llm_module
from common import SamplingParams
from common.formats.checkpoint import ModelNotFoundError
from common.formats.default_model import default_model_path
from offline import LLM
from scheduler_service.core.outputs import RequestOutput
from tests.common.test_cli_checks import lay_out_hub_cache
from tests.tiny_models import make_tiny_checkpoint


class Stop(Exception):
    pass


@pytest.fixture
def worker_configs(monkeypatch: pytest.MonkeyPatch) -> list:
    """The WorkerConfig each LLM would load (the load itself is stopped)."""
    configs: list = []

    def create(config):
        configs.append(config)
        raise Stop

    monkeypatch.setattr(llm_module, "create_worker_core", create)
    return configs


def test_llm_without_a_model_loads_the_default_model(worker_configs: list) -> None:
    with pytest.raises(Stop):
        LLM()
    with pytest.raises(Stop):
        LLM(block_size=32)
    assert [c.model for c in worker_configs] == [default_model_path()] * 2
    assert worker_configs[1].block_size == 32


def test_llm_names_a_missing_model_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError) as raised:
        LLM("Qwen/Qwen3-0.6B")
    assert str(raised.value) == (
        f"model: Qwen/Qwen3-0.6B is not a path and not in the local Hugging Face cache ({tmp_path}); nothing is "
        "downloaded: get it with `hf download Qwen/Qwen3-0.6B` (or `huggingface-cli download Qwen/Qwen3-0.6B`), "
        "or give a checkpoint folder or .gguf file")
    assert isinstance(raised.value, FileNotFoundError) and isinstance(raised.value, ValueError)
    with pytest.raises(FileNotFoundError, match=f"^model: {tmp_path / 'absent'} does not exist$"):
        LLM(str(tmp_path / "absent"))


def test_llm_loads_a_hub_id_from_the_local_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint = make_tiny_checkpoint(tmp_path / "made", "qwen3")
    snapshot = lay_out_hub_cache(tmp_path / "hub", "org/tiny", {})
    for file in checkpoint.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM("org/tiny", block_size=16, num_kv_blocks=16, device="cpu") as llm:
        assert llm.model == str(snapshot)
        from_cache = llm.generate([[5, 17, 99]], params, use_tqdm=False)[0]["token_ids"]
    with LLM(str(checkpoint), block_size=16, num_kv_blocks=16, device="cpu") as llm:
        assert llm.generate([[5, 17, 99]], params, use_tqdm=False)[0]["token_ids"] == from_cache


def _step(new: list[int], running: list[int]) -> SimpleNamespace:
    """A step whose new sequences compute `new` prompt tokens each and whose running ones `running`
    tokens each (0: a decode)."""
    request = SimpleNamespace(new_sequences=[SimpleNamespace(token_ids=[1] * n) for n in new],
                              running_sequences=[SimpleNamespace(token_ids=[1] * n) for n in running])
    return SimpleNamespace(request=request)


def _outputs(tokens_per_sequence: list[int], finished: int = 0) -> list[RequestOutput]:
    return [RequestOutput(seq_id=i, token_ids=[7] * n, finished=i < finished)
            for i, n in enumerate(tokens_per_sequence)]


def test_progress_shows_the_rates_of_the_run_so_far() -> None:
    now = [100.0]
    sequences = [SimpleNamespace(seq_id=i) for i in range(2)]
    progress = llm_module._Progress(sequences, enabled=True, clock=lambda: now[0])  # type: ignore
    try:
        now[0] = 100.5  # a 0.5 s prefill of two prompts (300 tokens), each sampling its first token
        progress.on_step(_step([200, 100], []), _outputs([1, 1]), period_s=None)  # type: ignore[arg-type]
        assert progress.rates == {"prefill": "600tok/s", "decode": "4tok/s"}
        for _ in range(10):  # decodes of 4 iterations, 0.1 s each: no prefill, and the rate says so truly
            now[0] += 0.1
            progress.on_step(_step([], [0, 0]), _outputs([4, 4]), period_s=0.1)  # type: ignore[arg-type]
        assert progress.rates == {"prefill": "200tok/s", "decode": "55tok/s"}  # 300 / 1.5 s, 82 / 1.5 s
        now[0] += 0.001  # a last, very short step: a one-step rate would read 8000tok/s
        progress.on_step(_step([], [0, 0]), _outputs([4, 4], finished=2), period_s=0.001)  # type: ignore[arg-type]
        assert progress.rates == {"prefill": "200tok/s", "decode": "60tok/s"}
        assert (progress.num_prefill_tokens, progress.num_decode_tokens, progress.bar.n) == (300, 90, 2)
        assert progress.bar.postfix == "prefill=200tok/s, decode=60tok/s"
    finally:
        progress.bar.close()


def test_progress_counts_prefill_chunks_of_running_sequences() -> None:
    now = [0.0]
    progress = llm_module._Progress([SimpleNamespace(seq_id=0)], enabled=True,  # type: ignore
                                    clock=lambda: now[0])
    try:
        now[0] = 2.0
        progress.on_step(_step([64], [128, 0]), _outputs([0, 1]), period_s=None)  # type: ignore[arg-type]
        assert progress.rates == {"prefill": "96tok/s", "decode": "0tok/s"}  # (64 + 128) / 2 s; 1 / 2 s rounds to 0
    finally:
        progress.bar.close()
