"""Host tier: a preallocated pool; bit-exact copies; full means refuse, not evict."""

from __future__ import annotations

import torch

from kvtier.tiers import HostTier


def test_round_trip_is_bit_exact_for_bf16_and_fp32(make_payload, same) -> None:
    tier = HostTier(1 << 20, slot_bytes=4096)
    for seed, dtype in enumerate([torch.bfloat16, torch.float32]):
        payload = make_payload(tokens=16, dtype=dtype, seed=seed)
        assert tier.put(bytes([seed]), payload)
        assert same(tier.get(bytes([seed])), payload)
    assert tier.stats.hits == 2 and tier.stats.errors == 0


def test_get_reads_into_the_callers_buffer(make_payload, same) -> None:
    tier = HostTier(1 << 20, slot_bytes=4096)
    payload = make_payload(tokens=16)
    tier.put(b"k", payload)
    out = torch.empty(payload.nbytes + 100, dtype=torch.uint8)
    got = tier.get(b"k", out=out)
    assert same(got, payload)
    assert got is not None and got.data is not None and got.data.data_ptr() == out.data_ptr()


def test_a_payload_may_span_scattered_slots(make_payload, same) -> None:
    tier = HostTier(64 * 1024, slot_bytes=4096)
    small = make_payload(tokens=1)  # 1 KiB: one slot each
    for i in range(16):
        assert tier.put(bytes([i]), small)
    for i in range(0, 16, 2):
        tier.delete(bytes([i]))  # every other slot free: no two adjacent
    big = make_payload(tokens=16, seed=7)  # 16 KiB: four scattered slots
    assert tier.put(b"big", big)
    assert same(tier.get(b"big"), big)


def test_full_pool_refuses_and_counts_it(make_payload) -> None:
    tier = HostTier(32 * 1024, slot_bytes=4096)
    payload = make_payload(tokens=16)  # 16 KiB
    assert tier.put(b"a", payload) and tier.put(b"b", payload)
    assert not tier.fits(payload.nbytes)
    assert not tier.put(b"c", payload)
    assert tier.stats.refused == 1
    assert tier.used_bytes == tier.capacity_bytes == 32 * 1024
    tier.delete(b"a")
    assert tier.put(b"c", payload)


def test_namespaces_do_not_see_each_other(make_payload) -> None:
    tier = HostTier(1 << 20, slot_bytes=4096)
    tier.put(b"k", make_payload(), namespace="tenant-a")
    assert tier.contains(b"k", namespace="tenant-a")
    assert not tier.contains(b"k", namespace="tenant-b")
    assert tier.get(b"k", namespace="tenant-b") is None
    assert tier.stats.misses == 1


def test_overwrite_reuses_room_and_wrong_out_is_an_error_not_an_exception(make_payload) -> None:
    tier = HostTier(16 * 1024, slot_bytes=4096)
    payload = make_payload(tokens=16)  # exactly the pool
    assert tier.put(b"k", payload)
    assert tier.put(b"k", make_payload(tokens=16, seed=1))  # replaces in place
    assert tier.get(b"k", out=torch.empty(10, dtype=torch.uint8)) is None
    assert tier.stats.errors == 1
