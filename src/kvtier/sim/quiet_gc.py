"""Building a large workload without Python's cyclic garbage collector.

Generating and flattening a workload allocates millions of objects that all live on (the
requests, their block ids, their messages) and almost no reference cycles. The collector
still runs a full collection each time enough new objects have piled up, and each one walks
everything built so far: on 10,000 conversations that was 13 of the 27 s the requests took
(`kvtier simulate --workload default --workload-set sessions=10000 ...`, 2026-12-04). While
a workload is built the collector is off; anything cyclic it left is found at the next
collection after.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


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
