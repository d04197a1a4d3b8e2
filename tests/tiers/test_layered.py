"""Layered records (version 2, or 3 signed): a chunk stored layer-major with one checksum per
layer, read whole (as any record) or a layer at a time into scattered slabs, from real segment
files and a real redis-server; damage to one layer fails that layer alone; a forged layer of a
signed record (checksums made to match) fails the read at its last layer; old and sealed
records stay whole-only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.tiers import Payload
from kvtier.tiers.base import LayerRead
from kvtier.tiers.crypto import Sealer, Signer
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.record import (
    FLAG_SIGNED,
    VERSION_LAYERED,
    VERSION_SIGNED_LAYERED,
    parse_head,
)
from kvtier.tiers.redis_tier import RedisTier

BLOCKS, LAYERS, PER_LAYER = 4, 5, 2 * 3 * 16 * 8  # [blocks, layers, 2, heads, bs, dim] bf16


def chunk(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BLOCKS, LAYERS, 2, 3, 16, 8, generator=g).to(torch.bfloat16)


def slabs_of(dest: torch.Tensor, layer: int) -> list[memoryview]:
    """Layer `layer` of each block of a block-major uint8 [blocks, layers, n] tensor."""
    return [memoryview(dest[b, layer].numpy()).cast("B") for b in range(BLOCKS)]


def read_all_layers(
    tier, key: bytes, head, order: range | list[int] = range(LAYERS)
) -> tuple[torch.Tensor, list[bool]]:
    """Layers read one call each, in `order`, with one check for the whole read."""
    dest = torch.zeros(BLOCKS, LAYERS, PER_LAYER * 2, dtype=torch.uint8)
    check = tier.layer_check(head)
    oks = [
        tier.read_layer([LayerRead(key, "ns", head, slabs_of(dest, i), check)], i)[0] for i in order
    ]
    return dest, oks


def as_bytes(kv: torch.Tensor) -> torch.Tensor:
    return kv.view(torch.uint8).view(BLOCKS, LAYERS, -1)


def layered_tier_of(request, tmp_path: Path, signer: Signer | None = None):
    """A disk or Redis tier (`request.param`) writing layered records, signed with `signer`."""
    if request.param == "disk":
        return DiskTier(tmp_path / "d", 64 << 20, layered=True, signer=signer)
    url = request.getfixturevalue("redis_url")
    prefix = "kvt-signed" if signer else "kvt"
    return RedisTier(url, 64 << 20, layered=True, signer=signer, prefix=prefix)


@pytest.fixture(params=["disk", "redis"])
def layered_tier(request, tmp_path: Path):
    tier = layered_tier_of(request, tmp_path)
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
    dest, oks = read_all_layers(tier, b"k", head, [0, 1, 2])
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


def test_unlayered_and_sealed_records_are_read_whole_only(tmp_path: Path, redis_url) -> None:
    old = DiskTier(tmp_path / "old", 64 << 20, persist=True)  # writes version-1 records
    kv = chunk(4)
    old.put(b"k", Payload.of(kv), namespace="ns")
    old.close()
    new = DiskTier(tmp_path / "old", 64 << 20, persist=True, layered=True)
    assert new.layer_heads([(b"k", "ns")]) == [None]
    assert torch.equal(new.get(b"k", namespace="ns").tensor(), kv)
    new.close()
    sealed = RedisTier(redis_url, 64 << 20, layered=True, sealer=Sealer(bytes(32)))
    sealed.put(b"s", Payload.of(kv), namespace="ns")
    assert sealed.layer_heads([(b"s", "ns")]) == [None]
    raw = sealed._connection().get(sealed.redis_key(b"s", "ns"))
    assert parse_head(raw).layer_sums == ()  # sealed: a version-1 record, decrypted whole
    assert torch.equal(sealed.get(b"s", namespace="ns").tensor(), kv)
    sealed.close()


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


# ----- signed layered records (version 3) --------------------------------------------------


@pytest.fixture(params=["disk", "redis"])
def signed_tier(request, tmp_path: Path):
    tier = layered_tier_of(request, tmp_path, Signer(bytes(range(32))))
    yield tier
    tier.close()


def test_signed_layered_record_reads_by_layer_and_whole(signed_tier) -> None:
    kv = chunk(6)
    assert signed_tier.put(b"k", Payload.of(kv), namespace="ns")
    (head,) = signed_tier.layer_heads([(b"k", "ns")])
    assert head is not None and head.flags & FLAG_SIGNED and len(head.layer_sums) == LAYERS
    assert head.raw[4] == VERSION_SIGNED_LAYERED
    dest, oks = read_all_layers(signed_tier, b"k", head)
    assert all(oks) and torch.equal(dest, as_bytes(kv))
    assert torch.equal(signed_tier.get(b"k", namespace="ns").tensor(), kv)
    # the signature spans the layers in order: a read that skips or reorders them fails
    _, oks = read_all_layers(signed_tier, b"k", head, [0, 2, 1])
    assert oks == [True, False, False]


def flip_one_byte_of_layer_1(body: bytearray, step: int) -> None:
    body[step + 5] ^= 0x01


def swap_layers_1_and_2(body: bytearray, step: int) -> None:
    body[step : 2 * step], body[2 * step : 3 * step] = (
        body[2 * step : 3 * step],
        body[step : 2 * step],
    )


@pytest.mark.parametrize("change", [flip_one_byte_of_layer_1, swap_layers_1_and_2])
def test_forged_layer_of_a_signed_record_fails_the_read(
    redis_url: str, forge_layered, change
) -> None:
    signer = Signer(bytes(range(32)))
    tier = RedisTier(redis_url, 64 << 20, layered=True, signer=signer, prefix="kvt-forged")
    kv = chunk(7)
    tier.put(b"k", Payload.of(kv), namespace="ns")
    client = tier._connection()
    rkey = tier.redis_key(b"k", "ns")
    client.set(rkey, forge_layered(client.get(rkey), change))
    (head,) = tier.layer_heads([(b"k", "ns")])
    assert head is not None  # the head's checksums match: only the key can tell
    _, oks = read_all_layers(tier, b"k", head)
    # every layer matches its (recomputed) checksum; the signature fails with the last
    assert oks == [True] * (LAYERS - 1) + [False]
    assert tier.get(b"k", namespace="ns") is None  # a whole read refuses it too
    tier.close()


def test_a_layer_from_another_record_fails_the_read(redis_url: str, forge_layered) -> None:
    """Two records signed with the same key, under the same name at different times: layer 3
    of the older one put into the newer one (checksums recomputed) does not verify."""
    tier = RedisTier(
        redis_url, 64 << 20, layered=True, signer=Signer(bytes(range(32))), prefix="kvt-mix"
    )
    client = tier._connection()
    rkey = tier.redis_key(b"k", "ns")
    tier.put(b"k", Payload.of(chunk(8)), namespace="ns")
    older = client.get(rkey)
    tier.put(b"k", Payload.of(chunk(9)), namespace="ns")
    old_body = older[parse_head(older).head_len :]

    def take_layer_3(body: bytearray, step: int) -> None:
        body[3 * step : 4 * step] = old_body[3 * step : 4 * step]

    client.set(rkey, forge_layered(client.get(rkey), take_layer_3))
    (head,) = tier.layer_heads([(b"k", "ns")])
    _, oks = read_all_layers(tier, b"k", head)
    assert oks == [True] * (LAYERS - 1) + [False]
    tier.close()


def test_signing_and_plain_tiers_serve_only_their_own_layered_records(redis_url: str) -> None:
    """A plain layered record planted where a signing tier reads is not served a layer at a
    time (nor whole); a plain tier does not serve a signed one by layers (its key would be
    needed to tell a forgery)."""
    plain = RedisTier(redis_url, 64 << 20, layered=True, prefix="kvt-own")
    signing = RedisTier(
        redis_url, 64 << 20, layered=True, signer=Signer(bytes(range(32))), prefix="kvt-own"
    )
    kv = chunk(10)
    plain.put(b"p", Payload.of(kv), namespace="ns")
    signing.put(b"s", Payload.of(kv), namespace="ns")
    assert signing.layer_heads([(b"p", "ns")]) == [None]
    assert signing.get(b"p", namespace="ns") is None
    assert plain.layer_heads([(b"s", "ns")]) == [None]
    plain.close()
    signing.close()
