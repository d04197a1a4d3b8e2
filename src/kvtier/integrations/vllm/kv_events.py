"""kvtier's tiers in vLLM's KV events: what a KV-aware router reads to find a session's KV.

Ownership: the worker side turns its `TierEventLog` (`tier_events.py`) into vLLM's
`BlockStored` / `BlockRemoved` after each forward (`worker_events`); vLLM's model runner
carries them to the scheduler process with the step's output (`KVConnectorOutput
.kv_cache_events`), where the scheduler-side connector keeps them (`SchedulerEvents`) until
vLLM's scheduler takes them (`take_events`) and publishes them beside its own device-block
events, on the publisher `kv_events_config` sets up (ZMQ).

What is published, one event per kvtier chunk and tier: `BlockStored` when a chunk lands in
a tier (written through, demoted into it), `BlockRemoved` when it leaves one (demoted out,
dropped off the last tier, deleted, found corrupt, evicted by the tier itself), `medium`
naming the tier (`host`, `disk`, `remote`; kvtier.vocab) and `locality` saying whether the
tier is this replica's (`LOCAL`) or shared by replicas (`REMOTE`, Redis). Block hashes are
vLLM's own, converted as vLLM converts its own (`maybe_convert_block_hash`), so an indexer
joins them with vLLM's device blocks.

Failure rules: best effort, like the log it reads: a missed event costs a router a miss,
never a wrong token. Events the scheduler has not taken are bounded: the oldest are dropped
and counted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from vllm.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvtier.integrations.vllm.tier_events import STORED, TierEvent

LOCAL = "LOCAL"
REMOTE = "REMOTE"


class KvtierKVEvents(KVConnectorKVEvents):
    """One step's events from the (single) worker: picklable, as vLLM's mp executor sends
    them to the scheduler process."""

    def __init__(self, events: list[KVCacheEvent] | None = None) -> None:
        self.events = list(events or [])
        self.workers = 1

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self.events.extend(events)

    def aggregate(self) -> KvtierKVEvents:
        return self  # one worker (the connector refuses more): nothing to reconcile

    def increment_workers(self, count: int = 1) -> None:
        self.workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return self.events

    def get_number_of_workers(self) -> int:
        return self.workers

    def clear_events(self) -> None:
        self.events = []


def to_vllm(event: TierEvent, shared_tiers: frozenset[str]) -> KVCacheEvent:
    blocks = event.blocks
    hashes = [maybe_convert_block_hash(h) for h in blocks.block_hashes]  # type: ignore[arg-type]
    locality = REMOTE if event.tier in shared_tiers else LOCAL
    if event.kind != STORED:
        return BlockRemoved(block_hashes=hashes, medium=event.tier, group_idx=0, locality=locality)
    parent = blocks.parent_block_hash
    # vLLM's extra keys, untagged as its own events publish them: the cache salt of block 0
    extra: list[tuple | None] = [None] * len(hashes)
    if blocks.cache_salt:
        extra[0] = (blocks.cache_salt,)
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None if parent is None else maybe_convert_block_hash(parent),  # type: ignore[arg-type]
        token_ids=blocks.token_ids.tolist(),
        block_size=blocks.block_size,
        lora_id=None,
        medium=event.tier,
        lora_name=None,
        extra_keys=extra,
        group_idx=0,
        locality=locality,
    )


def worker_events(events: list[TierEvent], shared_tiers: frozenset[str]) -> KvtierKVEvents | None:
    """This step's tier events for vLLM's step output (None when there are none)."""
    if not events:
        return None
    return KvtierKVEvents([to_vllm(event, shared_tiers) for event in events])


class SchedulerEvents:
    """The workers' events until vLLM's scheduler takes them (each step it publishes)."""

    def __init__(self, max_events: int = 65_536) -> None:
        self._events: deque[KVCacheEvent] = deque(maxlen=max_events)
        self.dropped = 0

    def add(self, events: Iterable[KVCacheEvent]) -> None:
        for event in events:
            if len(self._events) == self._events.maxlen:
                self.dropped += 1
            self._events.append(event)

    def take(self) -> list[KVCacheEvent]:
        taken = list(self._events)
        self._events.clear()
        return taken
