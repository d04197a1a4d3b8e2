"""Under any sequence of puts, deletes and gets: every budget holds at every step, and a hit
always returns the bytes last put under that key."""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path

import redis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.tiers import Chunk, DiskTier, HostTier, Payload, RedisTier, TierBackend, TieredStore

KIB = 1024
operations = st.lists(
    st.tuples(
        st.sampled_from(["put", "put", "get", "delete"]),
        st.integers(0, 7),  # key
        st.integers(1, 48 * KIB),  # payload bytes
    ),
    min_size=1,
    max_size=40,
)
budget_settings = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def payload_for(step: int, nbytes: int) -> Payload:
    return Payload.of(torch.full((nbytes,), step % 251, dtype=torch.uint8))


def run(tier: TierBackend, ops: list[tuple[str, int, int]], check) -> None:
    """Apply `ops`; after each, `check()` the budget; hits must be the last bytes put."""
    last: dict[bytes, int] = {}  # key -> step of the last successful put
    for step, (op, key_int, nbytes) in enumerate(ops):
        key = bytes([key_int]) * 16
        if op == "put":
            if tier.put(key, payload_for(step, nbytes)):
                last[key] = step
            # Refused: the older copy may remain or be gone, never be replaced by other bytes.
        elif op == "delete":
            tier.delete(key)
            last.pop(key, None)
        else:
            got = tier.get(key)
            if got is not None:
                assert key in last and got.data is not None
                assert bool((got.data == last[key] % 251).all())
        assert tier.used_bytes <= tier.capacity_bytes
        check()
    assert tier.stats.errors == 0


@budget_settings
@given(ops=operations)
def test_host_budget(ops) -> None:
    run(HostTier(128 * KIB, slot_bytes=4 * KIB), ops, lambda: None)


@budget_settings
@given(ops=operations, direct=st.booleans())
def test_disk_budget_counts_the_files_on_disk(ops, direct) -> None:
    with tempfile.TemporaryDirectory() as directory:
        capacity = 256 * KIB
        tier = DiskTier(directory, capacity, direct=direct, persist=True)

        def check() -> None:
            on_disk = sum(path.stat().st_size for path in Path(directory).glob("*.seg"))
            assert on_disk == tier.used_bytes <= capacity

        run(tier, ops, check)
        tier.close()
        reopened = DiskTier(directory, capacity, direct=direct, persist=True)
        check_reopened = sum(p.stat().st_size for p in Path(directory).glob("*.seg"))
        assert check_reopened == reopened.used_bytes <= capacity
        reopened.close()


@budget_settings
@given(ops=operations, on_full=st.sampled_from(["evict", "refuse"]))
def test_redis_budget_matches_the_server(redis_url, ops, on_full) -> None:
    prefix = f"budget-{uuid.uuid4().hex[:8]}"
    tier = RedisTier(redis_url, 200 * KIB, prefix=prefix, on_full=on_full)
    client = redis.Redis.from_url(redis_url)

    def check() -> None:
        keys = list(client.scan_iter(match=f"{prefix}:*".encode()))
        assert sum(len(key) + client.strlen(key) for key in keys) == tier.used_bytes

    run(tier, ops, check)
    tier.close()
    client.close()


@budget_settings
@given(ops=operations)
def test_store_keeps_every_tier_in_budget(ops) -> None:
    with tempfile.TemporaryDirectory() as directory:
        host = HostTier(64 * KIB, slot_bytes=4 * KIB)
        disk = DiskTier(directory, 160 * KIB)
        store = TieredStore([host, disk])
        last: dict[bytes, int] = {}
        for step, (op, key_int, nbytes) in enumerate(ops):
            chunk = Chunk((bytes([key_int]) * 16,))
            if op == "put":
                if store.put(chunk, payload_for(step, nbytes)):
                    last[chunk.id] = step
            elif op == "delete":
                store.delete(chunk.id)
            else:
                got = store.promote(chunk.id)
                if got is not None:
                    assert bool((got.data == last[chunk.id] % 251).all())
            for tier in (host, disk):
                assert tier.used_bytes <= tier.capacity_bytes
            assert len(store) <= len(host._held) + len(disk.entries())
        disk.close()
