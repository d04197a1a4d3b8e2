"""Replicas sharing one Redis: a store finds, on a miss in its own index, the chunks another
process wrote there, and restores them; a failing Redis finds nothing and raises nothing."""

from __future__ import annotations

import time

from kvtier.tiers import Chunk, HostTier, RedisTier, TieredStore

KEYS = [bytes([i]) * 8 for i in range(6)]  # six blocks; chunks of two


def replica(url: str, timeout_s: float = 0.5) -> TieredStore:
    host = HostTier(1 << 20, slot_bytes=4096)
    return TieredStore(
        [host, RedisTier(url, 1 << 22, timeout_s=timeout_s)], block_tokens=16, chunk_tokens=32
    )


def test_a_replica_finds_and_restores_what_another_wrote(redis_url, make_payload, same):
    writer, reader = replica(redis_url), replica(redis_url)
    full, short = Chunk(tuple(KEYS[0:2]), "acme"), Chunk(tuple(KEYS[2:3]), "acme")
    payloads = {full.id: make_payload(seed=1), short.id: make_payload(seed=2)}
    for chunk in (full, short):
        assert writer.put(chunk, payloads[chunk.id], tier="remote")
    assert reader.locate(full.id) is None

    # every grid chunk from block 0 at every length: the full one and the short second one
    assert reader.discover(KEYS[:4], "acme", deadline_s=30) == 2
    assert reader.locate(full.id).tier == reader.locate(short.id).tier == "remote"
    assert same(reader.promote(full.id), payloads[full.id])
    assert same(reader.promote(short.id), payloads[short.id])
    assert reader.snapshot()["discovered"] == 2
    assert reader.discover(KEYS[:4], "acme", deadline_s=30) == 0  # indexed now: not asked again


def test_discovery_starts_at_the_chunk_holding_the_first_block_asked(redis_url, make_payload):
    writer, reader = replica(redis_url), replica(redis_url)
    first = Chunk(tuple(KEYS[0:2]), "acme")
    writer.put(first, make_payload(), tier="remote")
    assert reader.discover(KEYS, "acme", first_block=2, deadline_s=30) == 0  # on the device already


def test_another_namespace_finds_nothing(redis_url, make_payload):
    writer, reader = replica(redis_url), replica(redis_url)
    writer.put(Chunk(tuple(KEYS[0:2]), "acme"), make_payload(), tier="remote")
    assert reader.discover(KEYS[:2], "beta", deadline_s=30) == 0


def test_a_dead_redis_finds_nothing_and_raises_nothing(own_redis, make_payload):
    writer, reader = replica(own_redis.url), replica(own_redis.url)
    writer.put(Chunk(tuple(KEYS[0:2]), "acme"), make_payload(), tier="remote")
    own_redis.stop()
    assert reader.discover(KEYS[:2], "acme", deadline_s=30) == 0
    assert reader.tiers["remote"].stats.errors >= 1


def test_stores_without_a_shared_tier_ask_nobody():
    store = TieredStore([HostTier(1 << 20, slot_bytes=4096)], block_tokens=16, chunk_tokens=32)
    assert store.discover(KEYS, "acme") == 0


def test_a_frozen_redis_holds_nobody_up_and_late_finds_still_count(own_redis, make_payload):
    writer, reader = replica(own_redis.url), replica(own_redis.url, timeout_s=60)
    chunk = Chunk(tuple(KEYS[0:2]), "acme")
    writer.put(chunk, make_payload(), tier="remote")
    reader.tiers["remote"].contains(b"x")  # connected (and counted) before the freeze
    own_redis.pause()
    try:
        # the look-up waits on the frozen server; the caller does not
        assert reader.discover(KEYS[:2], "acme", deadline_s=0.05) == 0
        assert reader.discover(KEYS[:2], "acme", deadline_s=0.05) == 0  # not asked twice
        assert reader.locate(chunk.id) is None
    finally:
        own_redis.resume()
    deadline = time.monotonic() + 30
    while reader.locate(chunk.id) is None:  # the late answer is indexed when it comes
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert reader.snapshot()["discovered"] == 1


def test_a_redis_that_bounds_nothing_is_warned_about_once(spawn_redis, caplog):
    unbounded = spawn_redis()
    bounded = spawn_redis("--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru")
    with caplog.at_level("WARNING", logger="kvtier.tiers.redis_tier"):
        for server in (unbounded, bounded):
            tier = RedisTier(server.url, 1 << 20, signer=None, sealer=None)
            tier.contains(b"x")
            tier.contains(b"y")
    warned = [r.getMessage() for r in caplog.records if "maxmemory=" in r.getMessage()]
    assert len(warned) == 1 and unbounded.url in warned[0]
