"""freeze_startup_objects takes what exists out of the collector's sight and leaves the rest to it."""
from __future__ import annotations

import gc
import weakref

from common.gc_pauses import freeze_startup_objects


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref:
    first, second = _Node(), _Node()
    first.other, second.other = second, first
    return weakref.ref(first)


def test_startup_objects_are_frozen_and_later_cycles_still_collected() -> None:
    before = _Node()
    freeze_startup_objects()
    assert gc.get_freeze_count() > 0
    assert not any(o is before for o in gc.get_objects())  # the permanent generation is not listed
    later = _cycle()
    gc.collect()
    assert later() is None
