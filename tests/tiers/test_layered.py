"""Layered records (version 2): a chunk stored layer-major with one checksum per layer, read
whole (as any record) or a layer at a time into scattered slabs, from real segment files and a
real redis-server; damage to one layer fails that layer alone; old records stay whole-only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.tiers import Payload
from kvtier.tiers.base import LayerRead
from kvtier.tiers.crypto import Signer
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.record import VERSION_LAYERED, parse_head
from kvtier.tiers.redis_tier import RedisTier

BLOCKS, LAYERS, PER_LAYER = 4, 5, 2 * 3 * 16 * 8  # [blocks, layers, 2, heads, bs, dim] bf16


def chunk(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BLOCKS, LAYERS, 2, 3, 16, 8, generator=g).to(torch.bfloat16)


def slabs_of(dest: torch.Tensor, layer: int) -> list[memoryview]:
    """Layer `layer` of each block of a block-major uint8 [blocks, layers, n] tensor."""
    return [memoryview(dest[b, layer].numpy()).cast("B") for b in range(BLOCKS)]


def read_all_layers(tier, key: bytes, head) -> tuple[torch.Tensor, list[bool]]:
    dest = torch.zeros(BLOCKS, LAYERS, PER_LAYER * 2, dtype=torch.uint8)
    oks = [
        tier.read_layer([LayerRead(key, "ns", head, slabs_of(dest, i))], i)[0]
        for i in range(LAYERS)
    ]
    return dest, oks


def as_bytes(kv: torch.Tensor) -> torch.Tensor:
    return kv.view(torch.uint8).view(BLOCKS, LAYERS, -1)


@pytest.fixture(params=["disk", "redis"])
def layered_tier(request, tmp_path: Path):
    if request.param == "disk":
        tier = DiskTier(tmp_path / "d", 64 << 20, layered=True)
    else:
        tier = RedisTier(request.getfixturevalue("redis_url"), 64 << 20, layered=True)
    yield tier
    tier.close()


def test_layer_reads_give_the_chunk_and_whole_reads_too(layered_tier) -> None:
    kv = chunk(1)
    assert layered_tier.put(b"k1", Payload.of(kv), namespace="ns")
    (head,) = layered_tier.layer_heads([(b"k1", "ns")])
    assert head is not None and len(head.layer_sums) == LAYERS
    dest, oks = read_all_layers(layered_tier, b"k1", head)
    assert all(oks)
    assert torch.equal(dest, as_bytes(kv))
    whole = layered_tier.get(b"k1", namespace="ns")  # laid back out block-major
    assert torch.equal(whole.tensor(), kv)
    assert layered_tier.layer_heads([(b"absent", "ns"), (b"k1", "other")]) == [None, None]


def test_one_damaged_layer_fails_alone(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "d", 64 << 20, layered=True)
    kv = chunk(2)
    tier.put(b"k", Payload.of(kv), namespace="ns")
    (head,) = tier.layer_heads([(b"k", "ns")])
    loc = tier._index[("ns", b"k")]
    offset, length = head.layer_span(2)
    with open(loc.segment.path, "r+b") as f:  # flip one byte in the middle of layer 2
        at = loc.offset + head.head_len + offset + length // 2
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    dest = torch.zeros(BLOCKS, LAYERS, PER_LAYER * 2, dtype=torch.uint8)
    oks = [
        tier.read_layer([LayerRead(b"k", "ns", head, slabs_of(dest, i))], i)[0] for i in (0, 1, 2)
    ]
    assert oks == [True, True, False]
    assert torch.equal(dest[:, :2], as_bytes(kv)[:, :2])
    assert tier.stats.corrupt == 1
    assert not tier.contains(b"k", namespace="ns")  # forgotten: later reads miss
    tier.close()


def test_redis_layer_read_damage_and_outage(redis_url: str, spawn_redis) -> None:
    tier = RedisTier(redis_url, 64 << 20, layered=True)
    kv = chunk(3)
    tier.put(b"k", Payload.of(kv), namespace="ns")
    (head,) = tier.layer_heads([(b"k", "ns")])
    client = tier._connection()
    offset, _ = head.layer_span(1)
    client.setrange(tier.redis_key(b"k", "ns"), head.head_len + offset + 7, b"\x00\xff")
    _, oks = read_all_layers(tier, b"k", head)
    assert oks == [True, False, True, True, True]
    tier.close()
    server = spawn_redis()
    tier = RedisTier(server.url, 64 << 20, layered=True, timeout_s=0.2)
    tier.put(b"k", Payload.of(kv), namespace="ns")
    (head,) = tier.layer_heads([(b"k", "ns")])
    server.stop()  # dies between the head and the layers
    _, oks = read_all_layers(tier, b"k", head)
    assert oks == [False] * LAYERS
    tier.close()


def test_unlayered_and_protected_records_are_read_whole_only(tmp_path: Path, redis_url) -> None:
    old = DiskTier(tmp_path / "old", 64 << 20, persist=True)  # writes version-1 records
    kv = chunk(4)
    old.put(b"k", Payload.of(kv), namespace="ns")
    old.close()
    new = DiskTier(tmp_path / "old", 64 << 20, persist=True, layered=True)
    assert new.layer_heads([(b"k", "ns")]) == [None]
    assert torch.equal(new.get(b"k", namespace="ns").tensor(), kv)
    new.close()
    signed = RedisTier(redis_url, 64 << 20, layered=True, signer=Signer(bytes(32)))
    signed.put(b"s", Payload.of(kv), namespace="ns")
    assert signed.layer_heads([(b"s", "ns")]) == [None]
    raw = signed._connection().get(signed.redis_key(b"s", "ns"))
    assert parse_head(raw).layer_sums == ()  # signed: a version-1 record, one MAC over all
    assert torch.equal(signed.get(b"s", namespace="ns").tensor(), kv)
    signed.close()


def test_layered_record_head_is_version_2_and_scans_back(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "d", 64 << 20, persist=True, layered=True)
    kv = chunk(5)
    tier.put(b"k", Payload.of(kv), namespace="ns")
    loc = tier._index[("ns", b"k")]
    with open(loc.segment.path, "rb") as f:
        f.seek(loc.offset + 4)
        assert f.read(1)[0] == VERSION_LAYERED
    tier.close()
    again = DiskTier(tmp_path / "d", 64 << 20, persist=True, layered=True)  # recovery scan
    (head,) = again.layer_heads([(b"k", "ns")])
    dest, oks = read_all_layers(again, b"k", head)
    assert all(oks) and torch.equal(dest, as_bytes(kv))
    again.close()
