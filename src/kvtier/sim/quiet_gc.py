"""The simulator's settings for Python's cyclic garbage collector, around its two phases that
allocate the most: building the workload, and running the event loop. Both restore the
collector as they found it.

- `without_cyclic_gc`: while a workload is built. Generating and flattening one allocates
  millions of objects that all live on (the requests, their block ids, their messages) and
  almost no reference cycles, and each full collection walks everything built so far: on
  10,000 conversations that was 13 of the 27 s the requests took (`kvtier simulate --workload
  default --workload-set sessions=10000 ...`, 2026-12-04). With the collector off, anything
  cyclic left is found at the next collection after.
- `relaxed_during_run`: while the event loop runs. What exists before it (the workload, its
  requests) is frozen, so collections do not walk it again, and young collections run every
  `GC_YOUNG_THRESHOLD` allocations.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

# Allocations between young-generation collections while the event loop runs (Python's default
# is 700). A simulation allocates millions of short-lived objects (views, actions, records) that
# reference counting frees; few form cycles, so at the default the collector mostly walks live
# objects for nothing (on a Mooncake trace slice it was about a sixth of the run's CPU time).
GC_YOUNG_THRESHOLD = 100_000


@contextmanager
def without_cyclic_gc() -> Iterator[None]:
    """Turn the cyclic collector off for the block, and back on after it if it was on."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


@contextmanager
def relaxed_during_run() -> Iterator[None]:
    """Freeze what exists now and collect the young generation every `GC_YOUNG_THRESHOLD`
    allocations for the block; the thresholds and the frozen set are restored after."""
    threshold = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()
