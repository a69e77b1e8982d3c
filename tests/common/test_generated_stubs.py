"""The committed stubs under common/generated must be what `python -m common.gen_protos` produces
from proto/ now; regenerate and commit them when this fails."""
from __future__ import annotations

from pathlib import Path

import pytest

from common import gen_protos

pytest.importorskip("grpc_tools", reason="grpcio-tools (dev extra) generates the stubs")


def sources(root: Path) -> dict[str, bytes]:
    """The .py and .pyi files under root (not the __pycache__ that importing the stubs leaves)."""
    return {name: content for name, content in gen_protos.generated_files(root).items()
            if name.endswith((".py", ".pyi")) and "__pycache__" not in name}


def test_committed_stubs_match_the_protos(tmp_path: Path) -> None:
    gen_protos.generate(tmp_path)
    fresh = sources(tmp_path / gen_protos.VIRTUAL_PREFIX)
    committed = sources(gen_protos.GENERATED_ROOT)
    assert sorted(fresh) == sorted(committed), "stale stub files: run python -m common.gen_protos"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stubs out of date: {stale}; run python -m common.gen_protos"
