"""What a persistent disk tier receives before the process exits (`TieredConnector.close`).

The device pool and the host tier are memory: the process takes them with it. With a
persistent disk tier, closing the connector (a graceful shutdown: SIGTERM to `kvtier serve`)
first spends at most `shutdown_flush_s` seconds writing to disk, in this order:

1. the writes still queued on the mover (spills, and the host's copies to disk);
2. the chunks of cached device blocks that no tier holds (sessions the policy kept on the
   device, finished requests never evicted), the latest finished first;
3. the host's chunks that have no copy on disk (all of them with `disk_copy = "on_shutdown"`),
   least recently used first, demoted.

It runs on the closing thread once serving has stopped, so nothing else writes meanwhile. What
the deadline cuts off is lost with the process, as without the flush; a kill -9 skips it all,
and what is on disk then is what the host's copies (`disk_copy = "on_write"`) wrote.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from kvtier.vocab import DISK, HOST

if TYPE_CHECKING:
    from kvtier.cache.connector import TieredConnector

log = logging.getLogger(__name__)


def flush_to_disk(connector: TieredConnector, seconds: float) -> None:
    """Write to the disk tier, within `seconds`, what the process would lose (module doc)."""
    start = time.monotonic()
    deadline = start + seconds
    log.info("writing the KV cache to disk before exit (at most %g s: shutdown_flush_s)", seconds)
    connector.writes.flush(seconds)
    store, chunks = connector.store, connector.chunks
    device = connector.spiller.unstored_chunks()
    host = (
        [c for c in store.chunks_in(HOST) if _without_copy(connector, c)]
        if HOST in store.tiers
        else []
    )
    tried = written = nbytes = 0
    for chunk, block_ids in device:
        if time.monotonic() >= deadline:
            break
        tried += 1
        payload, ready = chunks.gather(block_ids)
        ready()
        if store.put(chunk, payload, tier=DISK, form=chunks.form_of(block_ids)):
            written += 1
            nbytes += payload.nbytes
    from_device = written
    for chunk_id in host:
        placement = store.locate(chunk_id)
        if time.monotonic() >= deadline:
            break
        tried += 1
        if placement is not None and store.demote(chunk_id, DISK):
            written += 1
            nbytes += placement.nbytes
    left = len(device) + len(host) - tried
    if left or not connector.writes.flush(0):
        log.warning(
            "shutdown_flush_s (%g s) ran out: %d chunks written to disk; %d more, and any "
            "writes still queued, are lost",
            seconds,
            written,
            left,
        )
        return
    log.info(
        "wrote %d device and %d host chunks (%.1f MB) to disk in %.2f s%s",
        from_device,
        written - from_device,
        nbytes / 1e6,
        time.monotonic() - start,
        f"; {tried - written} failed (the disk tier's errors count them)"
        if tried > written
        else "",
    )


def _without_copy(connector: TieredConnector, chunk_id: bytes) -> bool:
    placement = connector.store.locate(chunk_id)
    return placement is not None and placement.copy is None
