"""Where a checkpoint path points: shared by the worker (weights) and the scheduler (tokenizer)."""
from __future__ import annotations

from pathlib import Path


def find_gguf_file(path: Path) -> Path | None:
    """The GGUF file that path names, or the only one in the folder it names (a folder with a
    config.json is a Hugging Face checkpoint, whatever else it holds)."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        candidates = sorted(path.glob("*.gguf"))
        if len(candidates) == 1:
            return candidates[0]
    return None
