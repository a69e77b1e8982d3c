"""Regenerates the committed protobuf and gRPC stubs under common/generated from proto/.

Run: python -m common.gen_protos (needs grpcio-tools, from the dev extra). The generated files
are committed because the GPU machines cannot generate them; tests/common/test_generated_stubs.py
fails when they are stale.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"
GENERATED_ROOT = REPO_ROOT / "common" / "generated"
# Protos are compiled under this virtual prefix so generated imports read
# `from common.generated.nanovllm... import ...`.
VIRTUAL_PREFIX = "common/generated"


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_root: Path) -> None:
    """Writes *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every proto under out_root/common/generated."""
    import grpc_tools
    from grpc_tools import protoc  # dev dependency only

    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{VIRTUAL_PREFIX}={PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
    ] + [f"{VIRTUAL_PREFIX}/{p.relative_to(PROTO_ROOT)}" for p in proto_files()]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    generated = out_root / VIRTUAL_PREFIX
    for folder in [generated, *[p for p in generated.rglob("*") if p.is_dir()]]:
        (folder / "__init__.py").touch()


def generated_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.py*")) if p.is_file()}


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = generated_files(Path(tmp) / VIRTUAL_PREFIX)
    for old in GENERATED_ROOT.rglob("*_pb2*.py*"):
        old.unlink()
    for name, content in fresh.items():
        target = GENERATED_ROOT / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
    print(f"wrote {len(fresh)} files under {GENERATED_ROOT.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
