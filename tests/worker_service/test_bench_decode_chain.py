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
