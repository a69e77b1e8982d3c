"""Where a checkpoint path points: shared by the worker (weights) and the scheduler (tokenizer), and
what a model name given by a user resolves to (a path, or a hub id in the local Hugging Face cache)."""
from __future__ import annotations

import os
import re
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


class ModelNotFoundError(FileNotFoundError, ValueError):
    """A model (or tokenizer) that names nothing usable: a usage error (ValueError: the command line
    exits 2) and a missing file (FileNotFoundError) at once. Its message is one line naming `name`."""


# A Hugging Face repository id: "org/name", each part letters, digits, "-", "_" and "." (not leading).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def is_hub_id(value: str) -> bool:
    """True when value reads as a Hugging Face repository id ("org/name"), not as a path."""
    return _HUB_ID.fullmatch(value) is not None and ".." not in value and not value.endswith((".gguf", "."))


def hub_cache_dir() -> Path:
    """The local Hugging Face hub cache, as huggingface_hub finds it, read now (not at import):
    $HF_HUB_CACHE, else $HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def resolve_model(value: str, name: str = "model", *, tokenizer: bool = False) -> str:
    """The checkpoint path that value names: an existing path as given, or a hub id ("org/name") as its
    snapshot folder in the local Hugging Face cache. Never downloads (whatever HF_HUB_OFFLINE says).
    Raises ModelNotFoundError, one line naming `name` (the flag) and value, for what names nothing
    usable: a missing path, a hub id not in the cache, a file that is no .gguf, a folder with neither
    config.json nor one .gguf file (tokenizer: any folder; one without tokenizer.json takes token ids)."""
    path = Path(value).expanduser()
    if not path.exists():
        if not is_hub_id(value):
            raise ModelNotFoundError(f"{name}: {value} does not exist")
        path = Path(_cached_snapshot(value, name))
        where = f"{value} (in the Hugging Face cache at {path})"
    else:
        where = value
    if find_gguf_file(path) is not None or (path.is_dir() and (tokenizer or (path / "config.json").exists())):
        return str(path)
    if path.is_dir():
        raise ModelNotFoundError(f"{name}: {where} holds neither config.json nor a single .gguf file")
    raise ModelNotFoundError(f"{name}: {where} is a file but not a .gguf file (give its folder or a .gguf file)")


def _cached_snapshot(repo_id: str, name: str) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        return snapshot_download(repo_id, cache_dir=str(cache), local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
        raise ModelNotFoundError(
            f"{name}: {repo_id} is not a path and not in the local Hugging Face cache ({cache}); nothing is "
            f"downloaded: get it with `hf download {repo_id}` (or `huggingface-cli download {repo_id}`), "
            "or give a checkpoint folder or .gguf file") from None
