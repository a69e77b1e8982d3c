"""What some files say, read again when one of them changes (its modification time, size or inode):
API keys and TLS certificates rotate without a restart."""
from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


class ReloadingFiles(Generic[T]):
    """`value` is what load() made of the files at paths; construction raises what os.stat or load raise."""

    def __init__(self, paths: Sequence[str], load: Callable[[], T]) -> None:
        self.paths, self._load = tuple(paths), load
        self._lock = threading.Lock()  # grpc's certificate fetcher runs on its own threads
        self._signature = self._stat()
        self.value = load()

    def _stat(self) -> list[tuple[int, int, int]]:
        return [(stat.st_mtime_ns, stat.st_size, stat.st_ino) for stat in map(os.stat, self.paths)]

    def reload_if_changed(self) -> T | None:
        """The new value when a file changed since the last load, else None. What os.stat or load raise
        passes through, the last value kept (and the reload tried again at the next call)."""
        with self._lock:
            signature = self._stat()
            if signature == self._signature:
                return None
            self.value, self._signature = self._load(), signature
            return self.value
