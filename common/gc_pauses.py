"""Keeps Python's cyclic garbage collector from stalling the serving loop.

After start-up a worker holds a great many long-lived objects (torch, Inductor's compiled graphs,
the model's modules, protobuf descriptors), and every full collection walks all of them: on an H200
the reference benchmark showed two stalls of about 250 ms with the GPU idle in a 7 s run. Freezing
them after start-up moves them out of the collector's sight (the same run then spent 78 ms in 436
collections, the longest 17.6 ms); the objects created while serving are still collected.
"""
from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


def freeze_startup_objects() -> None:
    """Collects once, then exempts every surviving object from future collections. Call it when
    start-up is over (model loaded, kernels compiled, graphs captured); calling it again later
    freezes what has been created since."""
    gc.collect()
    gc.freeze()
    logger.debug("gc: %d start-up objects frozen", gc.get_freeze_count())
