"""TieredStore: one index over all tiers; room is made by demoting the least recently used."""

from __future__ import annotations

import pytest
import torch

from kvtier.tiers import (
    Chunk,
    DiskTier,
    HostTier,
    Payload,
    RedisTier,
    SizeOnlyTier,
    TieredStore,
    chunk_id,
)

CHUNK = 16 * 1024  # make_payload(tokens=16)


def chunk(i: int, namespace: str = "t") -> Chunk:
    return Chunk((i.to_bytes(4, "big") * 8,), namespace)


@pytest.fixture
def store(tmp_path, redis_url):
    host = HostTier(4 * CHUNK, slot_bytes=CHUNK)
    disk = DiskTier(tmp_path / "disk", 1 << 20, persist=True)
    remote = RedisTier(redis_url, 1 << 20)
    yield TieredStore([host, disk, remote])
    for tier in (host, disk, remote):
        tier.close()


def test_chunks_follow_the_grid_and_have_stable_ids() -> None:
    store = TieredStore([SizeOnlyTier("host", 1 << 20)], block_tokens=16, chunk_tokens=64)
    keys = [bytes([i]) * 32 for i in range(10)]
    chunks = store.chunks(keys, namespace="t")
    assert [len(c.keys) for c in chunks] == [4, 4, 2]
    assert chunks[0].id == chunk_id(keys[:4]) == Chunk(tuple(keys[:4])).id
    assert chunks[0].id != chunks[1].id


def test_a_full_host_demotes_its_least_recently_used_chunk(store, make_payload, same) -> None:
    payloads = [make_payload(seed=i) for i in range(6)]
    for i in range(4):
        assert store.put(chunk(i), payloads[i])
    assert store.promote(chunk(0).id) is not None  # chunk 0 is now the most recent
    assert store.put(chunk(4), payloads[4])
    assert store.put(chunk(5), payloads[5])
    tiers = {i: store.locate(chunk(i).id).tier for i in range(6)}
    assert tiers == {0: "host", 1: "disk", 2: "disk", 3: "host", 4: "host", 5: "host"}
    for i in range(6):
        assert same(store.promote(chunk(i).id), payloads[i])
    tiers_ = store.tiers
    assert tiers_["host"].used_bytes <= tiers_["host"].capacity_bytes
    assert not tiers_["host"].contains(chunk(1).id, namespace="t")  # one copy per chunk


def test_promote_from_every_tier_into_the_callers_buffer(store, make_payload, same) -> None:
    payload = make_payload(dtype=torch.float32)
    for i, tier in enumerate(["host", "disk", "remote"]):
        assert store.put(chunk(i), payload, tier=tier)
        out = torch.empty(payload.nbytes, dtype=torch.uint8)
        got = store.promote(chunk(i).id, out=out)
        assert same(got, payload) and got.data.data_ptr() == out.data_ptr()
        assert store.locate(chunk(i).id).tier == tier


def test_demote_walks_down_and_off_the_last_tier(store, make_payload, same) -> None:
    payload = make_payload()
    store.put(chunk(0), payload)
    assert store.demote(chunk(0).id) and store.locate(chunk(0).id).tier == "disk"
    assert store.demote(chunk(0).id) and store.locate(chunk(0).id).tier == "remote"
    assert same(store.promote(chunk(0).id), payload)
    assert not store.demote(chunk(0).id)  # off the last tier: dropped
    assert store.locate(chunk(0).id) is None and store.promote(chunk(0).id) is None
    moves = store.snapshot()["moves"]
    assert moves["host->disk"]["bytes"] == moves["disk->remote"]["bytes"] == payload.nbytes
    assert moves["remote->dropped"]["ops"] == 1
    assert moves["remote->caller"]["ops"] == 1


def test_a_chunk_the_disk_gc_evicts_leaves_the_index(tmp_path, make_payload) -> None:
    disk = DiskTier(tmp_path, 256 * 1024)
    store = TieredStore([disk])
    for i in range(40):
        store.put(chunk(i), make_payload(seed=i))
    assert disk.stats.evicted > 0
    assert len(store) == len(disk.entries()) < 40
    assert store.locate(chunk(0).id) is None
    disk.close()


def test_a_corrupt_chunk_is_retried_then_forgotten(tmp_path, make_payload) -> None:
    disk = DiskTier(tmp_path, 1 << 20)
    store = TieredStore([disk])
    store.put(chunk(0), make_payload())
    segment = next(tmp_path.glob("*.seg"))
    data = bytearray(segment.read_bytes())
    data[-50] ^= 0x01
    segment.write_bytes(data)
    assert store.promote(chunk(0).id, attempts=3) is None
    assert store.locate(chunk(0).id) is None
    assert store.snapshot()["moves"]["disk->caller"]["failures"] == 3
    disk.close()


def test_recover_rebuilds_the_index_after_a_restart(tmp_path, redis_url, make_payload, same):
    payloads = [make_payload(seed=i) for i in range(3)]
    host = HostTier(4 * CHUNK, slot_bytes=CHUNK)
    disk = DiskTier(tmp_path, 1 << 20, persist=True)
    remote = RedisTier(redis_url, 1 << 20)
    store = TieredStore([host, disk, remote])
    store.put(chunk(0), payloads[0], tier="disk")
    store.put(chunk(1), payloads[1], tier="remote")
    store.put(chunk(2), payloads[2], tier="host")  # host memory does not survive
    for tier in (host, disk, remote):
        tier.close()

    host = HostTier(4 * CHUNK, slot_bytes=CHUNK)
    disk = DiskTier(tmp_path, 1 << 20, persist=True)
    remote = RedisTier(redis_url, 1 << 20)
    store = TieredStore([host, disk, remote])
    assert store.recover() == 2
    assert store.locate(chunk(0).id).tier == "disk"
    assert store.locate(chunk(1).id).tier == "remote"
    assert store.locate(chunk(1).id).nbytes == payloads[1].nbytes
    assert same(store.promote(chunk(0).id), payloads[0])
    assert same(store.promote(chunk(1).id), payloads[1])
    for tier in (host, disk, remote):
        tier.close()


def test_size_only_tiers_run_the_same_placement_and_accounting() -> None:
    host, disk = SizeOnlyTier("host", 4 * CHUNK), SizeOnlyTier("disk", 6 * CHUNK)
    store = TieredStore([host, disk])
    for i in range(12):
        assert store.put(chunk(i), Payload.sized(CHUNK, form="int8"))
        assert host.used_bytes <= host.capacity_bytes and disk.used_bytes <= disk.capacity_bytes
    placed = {i: store.locate(chunk(i).id) for i in range(12)}
    assert [i for i, p in placed.items() if p is None] == [0, 1]  # fell off the last tier
    assert [i for i, p in placed.items() if p and p.tier == "host"] == [8, 9, 10, 11]
    got = store.promote(chunk(5).id)
    assert got is not None and got.data is None and got.nbytes == CHUNK and got.form == "int8"
    moves = store.snapshot()["moves"]
    assert moves["caller->host"]["bytes"] == 12 * CHUNK
    assert moves["host->disk"]["ops"] == 8 and moves["disk->dropped"]["ops"] == 2


def test_a_payload_larger_than_a_tier_is_refused_without_evicting_anything() -> None:
    host = SizeOnlyTier("host", 4 * CHUNK)
    store = TieredStore([host])
    store.put(chunk(0), Payload.sized(CHUNK))
    assert not store.put(chunk(1), Payload.sized(5 * CHUNK))
    assert store.locate(chunk(0).id) is not None


def test_a_host_with_a_disk_copy_serves_reads_and_its_chunks_outlive_it(
    tmp_path, make_payload, same
) -> None:
    payloads = [make_payload(seed=i) for i in range(3)]
    host = HostTier(4 * CHUNK, slot_bytes=CHUNK)
    disk = DiskTier(tmp_path, 1 << 20, persist=True)
    store = TieredStore([host, disk], copy_to={"host": "disk"})
    for i, payload in enumerate(payloads):
        assert store.put(chunk(i), payload)
    assert {store.locate(chunk(i).id).tier for i in range(3)} == {"host"}  # reads: host
    assert disk.stats.writes == 3 and store.copy_bytes("disk") == 3 * CHUNK
    assert store.snapshot()["moves"]["host->disk:copy"]["ops"] == 3

    assert store.demote(chunk(0).id)  # into the copy's tier: the copy is taken, no write
    assert store.locate(chunk(0).id).tier == "disk" and disk.stats.writes == 3
    assert not host.contains(chunk(0).id, namespace="t")
    assert store.copy_bytes("disk") == 2 * CHUNK
    assert same(store.promote(chunk(0).id), payloads[0])
    store.delete(chunk(1).id)  # gone from both
    assert not disk.contains(chunk(1).id, namespace="t")
    host.close()
    disk.close()  # the process ends: host memory is lost, the copies are not

    disk = DiskTier(tmp_path, 1 << 20, persist=True)
    store = TieredStore([HostTier(4 * CHUNK, slot_bytes=CHUNK), disk])
    assert store.recover() == 2
    assert same(store.promote(chunk(0).id), payloads[0])
    assert same(store.promote(chunk(2).id), payloads[2])
    disk.close()


def test_a_copy_the_disk_gc_evicts_only_leaves_the_chunk_without_one(
    tmp_path, make_payload, same
) -> None:
    host = HostTier(64 * CHUNK, slot_bytes=CHUNK)
    disk = DiskTier(tmp_path, 256 * 1024)
    store = TieredStore([host, disk], copy_to={"host": "disk"})
    payloads = [make_payload(seed=i) for i in range(40)]
    for i, payload in enumerate(payloads):
        store.put(chunk(i), payload)
    assert disk.stats.evicted > 0
    assert store.locate(chunk(0).id).copy is None  # its copy was collected
    assert same(store.promote(chunk(0).id), payloads[0])  # the host still has it
    assert store.copy_bytes("disk") == len(disk.entries()) * CHUNK
    assert store.demote(chunk(0).id)  # written to disk now, as without copies
    assert store.locate(chunk(0).id).tier == "disk"
    assert same(store.promote(chunk(0).id), payloads[0])
    host.close()
    disk.close()
