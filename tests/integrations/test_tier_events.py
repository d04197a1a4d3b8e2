"""TierEventLog over a real TieredStore (size-only tiers, no vLLM): what a router is told
matches what the tiers hold, and chunks first placed without their vLLM blocks are announced
once a saved request describes them."""

from __future__ import annotations

import torch

from kvtier.integrations.vllm.messages import Save
from kvtier.integrations.vllm.requests import RequestRecord
from kvtier.integrations.vllm.tier_events import (
    REMOVED,
    STORED,
    TierEventLog,
    chunk_blocks,
    describe_saved,
)
from kvtier.tiers import Chunk, Payload, SizeOnlyTier, TieredStore

PAYLOAD = Payload.of(torch.zeros(1024, dtype=torch.uint8))


def chunk(i: int) -> Chunk:
    return Chunk((i.to_bytes(4, "big") * 8,), "t")


def blocks_of(i: int):
    hashes = [bytes([i, b]) * 16 for b in range(2)]
    return chunk_blocks(hashes, 0, 2, list(range(i, i + 8)), 4, None)


def two_tiers() -> TieredStore:
    return TieredStore([SizeOnlyTier("host", 2 * 1024), SizeOnlyTier("disk", 2 * 1024)])


def announced(events, state: dict | None = None) -> dict[bytes, str]:
    """Replay events as a router's index would: first block hash -> tier."""
    state = {} if state is None else state
    for event in events:
        key = event.blocks.block_hashes[0]
        if event.kind == STORED:
            assert key not in state, "stored twice without a removal"
            state[key] = event.tier
        else:
            assert state.pop(key) == event.tier, "removed from a tier it was not said to be in"
    return state


def held(store: TieredStore, described: range) -> dict[bytes, str]:
    out = {}
    for i in described:
        placement = store.locate(chunk(i).id)
        if placement is not None:
            out[blocks_of(i).block_hashes[0]] = placement.tier
    return out


def test_what_a_router_is_told_is_what_the_tiers_hold() -> None:
    store = two_tiers()
    log = TierEventLog(store, in_flight=lambda _: False)
    state: dict = {}
    for i in range(6):  # host holds 2, disk 2: demotions, then drops off the disk
        log.describe(chunk(i).id, blocks_of(i))
        store.put(chunk(i), PAYLOAD)
        announced(log.take(), state)
        assert state == held(store, range(6))
    store.delete(chunk(5).id)
    events = log.take()
    assert [(e.kind, e.tier) for e in events] == [(REMOVED, "host")]
    assert announced(events, state) == held(store, range(6))
    assert log.unannounced == 0 and log.dropped == 0


def test_a_chunk_placed_before_its_blocks_are_known_is_announced_when_described() -> None:
    store = two_tiers()
    log = TierEventLog(store, in_flight=lambda _: False)
    store.put(chunk(1), PAYLOAD, tier="disk")  # e.g. found in a shared tier
    assert log.take() == [] and log.unannounced == 1
    log.describe(chunk(1).id, blocks_of(1))  # a request holding it was saved here
    events = log.take()
    assert [(e.kind, e.tier, e.blocks) for e in events] == [(STORED, "disk", blocks_of(1))]
    assert log.take() == []  # told once


def test_what_the_store_held_at_start_is_announced_once_described() -> None:
    store = two_tiers()
    store.put(chunk(1), PAYLOAD)  # before the log exists: a recovered disk tier
    log = TierEventLog(store, in_flight=lambda _: False)
    log.describe(chunk(1).id, blocks_of(1))
    assert [(e.kind, e.tier) for e in log.take()] == [(STORED, "host")]


def test_placements_nobody_takes_are_bounded_and_counted() -> None:
    store = TieredStore([SizeOnlyTier("host", 1024)])
    log = TierEventLog(store, in_flight=lambda _: False, max_pending=4)
    for i in range(10):  # each put drops the previous chunk: 19 placements
        store.put(chunk(i), PAYLOAD)
    assert log.dropped == 15
    log.take()
    assert log.unannounced == 4


def test_a_described_chunk_whose_write_is_in_flight_keeps_its_blocks() -> None:
    store = TieredStore([SizeOnlyTier("host", 1024)])
    writing = {chunk(0).id}
    log = TierEventLog(store, in_flight=lambda cid: cid in writing)
    log.describe(chunk(0).id, blocks_of(0))
    for i in range(1, 80):  # many described chunks that left the store: forgotten
        log.describe(chunk(i).id, blocks_of(i))
        store.put(chunk(i), PAYLOAD)
        log.take()
    store.put(chunk(0), PAYLOAD)  # the write in flight lands
    events = log.take()
    assert (STORED, "host", blocks_of(0)) in [(e.kind, e.tier, e.blocks) for e in events]
    assert len(log._blocks) < 80  # bounded by what the store holds


def test_a_save_describes_its_full_chunks_with_vllm_hashes_parent_and_tokens() -> None:
    store = two_tiers()
    log = TierEventLog(store, in_flight=lambda _: False)
    record = RequestRecord("r", list(range(100, 120)), 20, cache_salt="s")
    keys = [bytes([b]) * 32 for b in range(5)]  # kvtier's keys of 5 blocks of 4 tokens
    hashes = [bytes([0xA0 + b]) * 32 for b in range(5)]
    # chunks of 2 blocks: the save copies out chunks 0 and 1; hashes arrive for 4 blocks
    describe_saved(log, record, Save("r", 0, 2, [], 0, [], 0, hashes[:4]), keys, 2, 4)
    for start in (0, 2):
        store.put(Chunk(tuple(keys[start : start + 2]), "t"), PAYLOAD)
    first, second = (e.blocks for e in log.take())
    assert first.block_hashes == tuple(hashes[:2]) and first.parent_block_hash is None
    assert list(first.token_ids) == list(range(100, 108)) and first.cache_salt == "s"
    assert second.block_hashes == tuple(hashes[2:4]) and second.parent_block_hash == hashes[1]
    assert list(second.token_ids) == list(range(108, 116)) and second.cache_salt is None
    assert record.block_hashes == hashes[:4]


def test_a_chunk_without_its_hashes_is_not_described() -> None:
    store = two_tiers()
    log = TierEventLog(store, in_flight=lambda _: False)
    record = RequestRecord("r", list(range(16)), 16)
    keys = [bytes([b]) * 32 for b in range(4)]
    describe_saved(log, record, Save("r", 0, 2, [], 0, [], 0, [b"h" * 32] * 3), keys, 2, 4)
    store.put(Chunk(tuple(keys[2:4]), "t"), PAYLOAD)
    assert log.take() == [] and log.unannounced == 1
