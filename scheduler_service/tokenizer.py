"""Loads the tokenizer, chat template and EOS ids of a checkpoint (a Hugging Face folder or a GGUF
file), without torch."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def _gguf_file(path: Path) -> Path | None:
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        candidates = sorted(path.glob("*.gguf"))
        return candidates[0] if len(candidates) == 1 else None
    return None


def load_tokenizer(model: str) -> Any | None:
    """The checkpoint's tokenizer, or None when it ships none (a bare test checkpoint)."""
    from transformers import AutoTokenizer

    path = Path(model)
    gguf = _gguf_file(path)
    if gguf is not None:
        return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    has_tokenizer = any((path / name).exists() for name in ("tokenizer.json", "tokenizer.model", "vocab.json"))
    if not has_tokenizer:
        logger.warning("%s ships no tokenizer: only token-id prompts will be accepted", model)
        return None
    return AutoTokenizer.from_pretrained(str(path))


def eos_token_ids(model: str, tokenizer: Any | None) -> set[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer together."""
    ids: set[int] = set()
    path = Path(model)
    for name in ("generation_config.json", "config.json"):
        file = path / name
        if path.is_dir() and file.exists():
            value = json.loads(file.read_text()).get("eos_token_id")
            ids.update(value if isinstance(value, list) else [value] if value is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
