"""bench/decode_chain.py runs: its chain of a decode layer's kernels, whole, with a kind left out and
with one kept, on tiny shapes (on a CPU through Triton's interpreter), before a GPU call is spent on it."""
from __future__ import annotations

from tests.worker_service.triton_runtime import skip_module_unless_kernels_run

skip_module_unless_kernels_run()

from bench import decode_chain  # noqa: E402


def test_every_kind_of_kernel_and_every_placeholder_runs(capsys) -> None:
    assert decode_chain.smoke() == 0
    assert capsys.readouterr().out.split("\n")[:3] == ["all six: ok", "without qkv: ok", "qkv alone: ok"]


def test_the_variants_leave_each_kind_out_once_and_keep_each_alone_once() -> None:
    names = [name for name, _ in decode_chain.variants()]
    kinds = set(decode_chain.KINDS)
    assert names[0] == "all six" and len(names) == 1 + 2 * len(kinds)
    for name, skipped in decode_chain.variants()[1:]:
        kind = name.removeprefix("without ").removesuffix(" alone")
        assert skipped == ({kind} if name.startswith("without") else kinds - {kind})


def test_the_product_sweep_tries_the_chosen_tiling_first_then_each_other_once() -> None:
    from worker_service.models.config import ModelConfig

    config = ModelConfig.from_hf_dict(decode_chain.QWEN3_0_6B)
    for n, k in decode_chain.product_shapes(config).values():
        tilings = decode_chain.tilings_to_try(1, n, k)
        assert tilings[0] == decode_chain._config(1, n, k)
        assert len(set(tilings)) == len(tilings) > 1
        assert all(not tiling.use_dot and tiling.block_k == tilings[0].block_k for tiling in tilings)
