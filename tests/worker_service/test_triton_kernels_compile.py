"""Every Triton kernel of the worker compiles for sm_90 (H100/H200) with the real compiler, on a
machine without a GPU: errors that Triton's interpreter cannot see (it runs kernels as Python) show
up in CI instead of on the GPU machine."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from tests.worker_service.kernel_compilation import Variant  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_every_kernel_compiles_for_sm90(tmp_path: Path) -> None:
    from tests.worker_service.kernel_compilation import variants

    # A fresh cache, so nothing compiled earlier answers for the compiler; no interpreter.
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    result = subprocess.run([sys.executable, "-m", "tests.worker_service.kernel_compilation"], cwd=REPO_ROOT,
                            env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    compiled = [line.split(":")[0] for line in result.stdout.splitlines()]
    assert compiled == [variant.name for variant in variants()]
    assert all("bytes of cubin" in line for line in result.stdout.splitlines())
    lines = {line.split(":")[0]: line for line in result.stdout.splitlines()}
    counts = {name: [int(part.split()[0]) for part in line.split(", ")[-2:]] for name, line in lines.items()}
    for variant in variants():
        # Kernels launched with programmatic dependent launch wait for the previous kernel (layers/triton_pdl).
        atomics, waits = counts[variant.name]
        expected = 1 if variant.constexprs.get("PDL") else 0
        assert waits == expected, f"{variant.name}: {waits} griddepcontrol.wait"
        if variant.name.startswith("decode"):
            check_decode_resources(variant.name, lines[variant.name])
        if variant.name.startswith("skinny") and variant.constexprs["ONE_PASS"]:
            check_weight_tile_loads(variant, lines[variant.name])
        if "IS_SPLIT" in variant.constexprs:  # the split decode's last program merges (attention/triton_decode):
            # one counter increment that releases its partials and acquires the other programs'
            assert atomics == int(variant.constexprs["IS_SPLIT"]), f"{variant.name}: {atomics} atomics"


def check_decode_resources(name: str, line: str) -> None:
    """The decode kernel's K/V tiles arrive by 16-byte async copies, and PROGRAMS_PER_SM of its programs fit
    in one multiprocessor's shared memory (228 KB on an H100/H200, 1 KB of it reserved a program), as
    attention/triton_decode.choose_num_splits counts on (otherwise a split grid runs in a second wave)."""
    from worker_service.attention.triton_decode import PROGRAMS_PER_SM

    shared = int(re.search(r"(\d+) bytes of shared memory", line).group(1))
    wide, copies = (int(number) for number in re.search(r"(\d+) of (\d+) async copies 16 bytes", line).groups())
    assert copies > 0 and wide == copies, f"{name}: {wide} of {copies} async copies are 16 bytes"
    assert PROGRAMS_PER_SM * (shared + 1024) <= 228 * 1024, f"{name}: {shared} bytes of shared memory a program"


def check_weight_tile_loads(variant: Variant, line: str) -> None:
    """A one-pass skinny product loads its whole weight tile before it waits for the previous kernel, in
    16-byte loads (8 bf16 a load) where the launch's 16-byte alignment lets Triton make them: a thread's
    16-byte loads (of the tile and of x) cover at least its share of the tile (unaligned: none)."""
    wide = int(re.search(r"(\d+) 16-byte loads", line).group(1))
    threads = 32 * variant.options["num_warps"]
    tile_bytes = 2 * variant.constexprs["BLOCK_N"] * variant.constexprs["BLOCK_K"]
    assert wide * 16 * threads >= tile_bytes, f"{variant.name}: {wide} 16-byte loads a thread"
