"""Layered records (version 2, 3 signed, 4 sealed): a chunk stored layer-major with one checksum
per layer, read whole (as any record) or a layer at a time into scattered slabs, from real
segment files and a real redis-server; damage to one layer fails that layer alone; a forged
layer of a signed or sealed record (checksums made to match) fails the read at its last layer;
old records stay whole-only, and readers from before version 4 miss sealed layered ones."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash

from kvtier.tiers import Payload
from kvtier.tiers.base import CorruptRecord, LayerRead, RejectedRecord
from kvtier.tiers.crypto import Sealer, Signer
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.record import (
    FLAG_SEALED,
    FLAG_SIGNED,
    VERSION_LAYERED,
    VERSION_SEALED_LAYERED,
    VERSION_SIGNED_LAYERED,
    encode_head,
    layer_major,
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


KEY = bytes(range(32))


def keyed(kind: str) -> dict:
    """A tier's protection: "signed" or "sealed" with the test key, or neither ("plain")."""
    return {"signed": {"signer": Signer(KEY)}, "sealed": {"sealer": Sealer(KEY)}}.get(kind, {})


def layered_tier_of(request, tmp_path: Path, place: str, kind: str = "plain"):
    """A "disk" or "redis" tier (`place`) writing layered records, protected as `kind`."""
    if place == "disk":
        return DiskTier(tmp_path / "d", 64 << 20, layered=True, **keyed(kind))
    url = request.getfixturevalue("redis_url")
    return RedisTier(url, 64 << 20, layered=True, prefix=f"kvt-{kind}", **keyed(kind))


@pytest.fixture(params=["disk", "redis"])
def layered_tier(request, tmp_path: Path):
    tier = layered_tier_of(request, tmp_path, request.param)
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


@pytest.mark.parametrize("kind", ["plain", "sealed"])
def test_unlayered_records_are_read_whole_only(tmp_path: Path, kind: str) -> None:
    old = DiskTier(tmp_path / "old", 64 << 20, persist=True, **keyed(kind))  # version 1
    kv = chunk(4)
    old.put(b"k", Payload.of(kv), namespace="ns")
    old.close()
    new = DiskTier(tmp_path / "old", 64 << 20, persist=True, layered=True, **keyed(kind))
    assert new.layer_heads([(b"k", "ns")]) == [None]
    assert torch.equal(new.get(b"k", namespace="ns").tensor(), kv)
    new.close()


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


# ----- signed (version 3) and sealed (version 4) layered records ---------------------------

# what marks each kind of keyed layered record
MARKS = {
    "signed": (FLAG_SIGNED, VERSION_SIGNED_LAYERED),
    "sealed": (FLAG_SEALED, VERSION_SEALED_LAYERED),
}


@pytest.fixture(
    params=[(place, kind) for kind in MARKS for place in ("disk", "redis")],
    ids=lambda param: "-".join(param),
)
def keyed_tier(request, tmp_path: Path):
    tier = layered_tier_of(request, tmp_path, *request.param)
    yield request.param[1], tier
    tier.close()


def test_keyed_layered_record_reads_by_layer_and_whole(keyed_tier) -> None:
    kind, tier = keyed_tier
    kv = chunk(6)
    assert tier.put(b"k", Payload.of(kv), namespace="ns")
    (head,) = tier.layer_heads([(b"k", "ns")])
    flag, version = MARKS[kind]
    assert head is not None and head.flags & flag and len(head.layer_sums) == LAYERS
    assert head.raw[4] == version
    dest, oks = read_all_layers(tier, b"k", head)
    assert all(oks) and torch.equal(dest, as_bytes(kv))
    assert torch.equal(tier.get(b"k", namespace="ns").tensor(), kv)
    # the signature or tag spans the layers in order: a read that skips or reorders them fails
    _, oks = read_all_layers(tier, b"k", head, [0, 2, 1])
    assert oks == [True, False, False]


def flip_one_byte_of_layer_1(body: bytearray, step: int) -> None:
    body[step + 5] ^= 0x01


def swap_layers_1_and_2(body: bytearray, step: int) -> None:
    body[step : 2 * step], body[2 * step : 3 * step] = (
        body[2 * step : 3 * step],
        body[step : 2 * step],
    )


@pytest.mark.parametrize("kind", ["signed", "sealed"])
@pytest.mark.parametrize("change", [flip_one_byte_of_layer_1, swap_layers_1_and_2])
def test_forged_layer_of_a_keyed_record_fails_the_read(
    redis_url: str, forge_layered, change, kind: str
) -> None:
    tier = RedisTier(redis_url, 64 << 20, layered=True, prefix=f"kvt-forged-{kind}", **keyed(kind))
    kv = chunk(7)
    tier.put(b"k", Payload.of(kv), namespace="ns")
    client = tier._connection()
    rkey = tier.redis_key(b"k", "ns")
    client.set(rkey, forge_layered(client.get(rkey), change))
    (head,) = tier.layer_heads([(b"k", "ns")])
    assert head is not None  # the head's checksums match: only the key can tell
    _, oks = read_all_layers(tier, b"k", head)
    # every layer matches its (recomputed) checksum; the tag fails with the last
    assert oks == [True] * (LAYERS - 1) + [False]
    assert tier.get(b"k", namespace="ns") is None  # a whole read refuses it too
    tier.close()


@pytest.mark.parametrize("kind", ["signed", "sealed"])
def test_a_layer_from_another_record_fails_the_read(
    redis_url: str, forge_layered, kind: str
) -> None:
    """Two records protected with the same key, under the same name at different times: layer
    3 of the older one put into the newer one (checksums recomputed) does not verify."""
    tier = RedisTier(redis_url, 64 << 20, layered=True, prefix=f"kvt-mix-{kind}", **keyed(kind))
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


def test_tiers_serve_only_layered_records_protected_as_theirs(redis_url: str) -> None:
    """Plain, signed and sealed layered records, each copied under every tier's name: each
    tier serves its own kind by layers and whole, and no other (a plain record planted where
    a keyed tier reads is no proof of origin; a plain tier can check no signature and open no
    seal; a signing tier opens no seal, and a sealing one takes no signature for one)."""
    kinds = ["plain", "signed", "sealed"]
    tiers = {
        kind: RedisTier(redis_url, 64 << 20, layered=True, prefix="kvt-own", **keyed(kind))
        for kind in kinds
    }
    kv = chunk(10)
    client = tiers["plain"]._connection()
    for kind, tier in tiers.items():
        tier.put(kind.encode(), Payload.of(kv), namespace="ns")
        value = client.get(tier.redis_key(kind.encode(), "ns"))
        for other in tiers.values():  # each kind and mode writes under names of its own
            client.set(other.redis_key(kind.encode(), "ns"), value)
    for reader, tier in tiers.items():
        for kind in kinds:
            served = kind == reader
            (head,) = tier.layer_heads([(kind.encode(), "ns")])
            assert (head is not None) == served, (reader, kind)
            whole = tier.get(kind.encode(), namespace="ns")
            assert (whole is not None and torch.equal(whole.tensor(), kv)) == served
    for tier in tiers.values():
        tier.close()


# ----- sealed layered records (version 4) --------------------------------------------------


@pytest.fixture(params=["disk", "redis"])
def sealed_tier(request, tmp_path: Path):
    tier = layered_tier_of(request, tmp_path, request.param, "sealed")
    yield tier
    tier.close()


def stored_body(tier, key: bytes) -> bytes:
    """The body of `key`'s record as the store holds it (Redis value or segment bytes)."""
    if isinstance(tier, RedisTier):
        raw = tier._connection().get(tier.redis_key(key, "ns"))
        return raw[parse_head(raw).head_len :]
    loc = tier._index[("ns", key)]
    with open(loc.segment.path, "rb") as f:
        f.seek(loc.offset + loc.head.head_len)
        return f.read(loc.head.body_len)


def test_sealed_layers_are_ciphertext_under_a_fresh_nonce(sealed_tier) -> None:
    """What the store holds is neither the chunk nor its layer-major layout, and the same
    chunk sealed twice gets another nonce, so another ciphertext."""
    kv = chunk(12)
    plain = bytes(layer_major(Payload.of(kv).data, BLOCKS, LAYERS))
    sealed_tier.put(b"a", Payload.of(kv), namespace="ns")
    sealed_tier.put(b"b", Payload.of(kv), namespace="ns")
    heads = sealed_tier.layer_heads([(b"a", "ns"), (b"b", "ns")])
    assert heads[0].body_len == heads[0].payload_nbytes == len(plain)  # nonce and tag in head
    bodies = [stored_body(sealed_tier, key) for key in (b"a", b"b")]
    assert heads[0].mac[:12] != heads[1].mac[:12]
    assert bodies[0] != bodies[1]
    for body in bodies:
        # counter mode: a byte equal by chance 1 time in 256, never most of them
        assert sum(x == y for x, y in zip(body[:4096], plain[:4096], strict=True)) < 64
    assert all(
        torch.equal(read_all_layers(sealed_tier, k, h)[0], as_bytes(kv))
        for k, h in zip((b"a", b"b"), heads, strict=True)
    )


def test_forged_sealed_layer_on_disk_fails_at_the_last_layer(tmp_path: Path, forge_layered) -> None:
    """A segment file edited by whoever can write it: layer 2's ciphertext changed, every
    checksum recomputed; a restarted tier indexes the record (its head is sound), every layer
    passes its checksum and the tag fails with the last; a whole read refuses it too."""
    tier = DiskTier(tmp_path / "d", 64 << 20, persist=True, layered=True, **keyed("sealed"))
    tier.put(b"k", Payload.of(chunk(13)), namespace="ns")
    loc = tier._index[("ns", b"k")]
    path, offset, length = loc.segment.path, loc.offset, loc.head.record_len
    tier.close()

    def flip_in_layer_2(body: bytearray, step: int) -> None:
        body[2 * step + 100] ^= 0x40

    with open(path, "r+b") as f:
        f.seek(offset)
        forged = forge_layered(f.read(length), flip_in_layer_2)
        assert len(forged) == length
        f.seek(offset)
        f.write(forged)
    again = DiskTier(tmp_path / "d", 64 << 20, persist=True, layered=True, **keyed("sealed"))
    (head,) = again.layer_heads([(b"k", "ns")])
    assert head is not None
    _, oks = read_all_layers(again, b"k", head)
    assert oks == [True] * (LAYERS - 1) + [False]
    again.close()
    again = DiskTier(tmp_path / "d", 64 << 20, persist=True, layered=True, **keyed("sealed"))
    assert again.get(b"k", namespace="ns") is None
    assert again.stats.rejected == 1
    again.close()


@pytest.mark.parametrize("kind", ["signed", "sealed"])
def test_layer_table_that_disagrees_with_the_shape_is_refused(redis_url: str, kind: str) -> None:
    """The layer table is outside what the key authenticates: one rewritten to say 4 layers
    (sums and head checksum recomputed) over the authentic body would lay it out wrong on a
    whole read. Neither a layer read nor a whole read serves it."""
    tier = RedisTier(redis_url, 64 << 20, layered=True, prefix=f"kvt-table-{kind}", **keyed(kind))
    tier.put(b"k", Payload.of(chunk(14)), namespace="ns")
    client = tier._connection()
    rkey = tier.redis_key(b"k", "ns")
    raw = client.get(rkey)
    head = parse_head(raw)
    body = raw[head.head_len :]
    step = len(body) // (LAYERS - 1)
    sums = tuple(xxhash.xxh3_64_intdigest(body[i * step : (i + 1) * step]) for i in range(4))
    forged = encode_head(
        head.key,
        head.namespace,
        head.meta,
        body,
        head.flags,
        head.written_at,
        head.mac,
        sums,
        head.key_id,
    )
    client.set(rkey, forged + body)
    assert tier.layer_heads([(b"k", "ns")]) == [None]
    assert tier.get(b"k", namespace="ns") is None
    with pytest.raises(CorruptRecord, match="layer table"):
        tier._codec.decode(
            parse_head(forged), body, torch.empty(len(body), dtype=torch.uint8), in_place=False
        )
    tier.close()


# the last commit before version 4: its record.py is what an older kvtier reads with
BEFORE_VERSION_4 = "e2988d7"


def test_a_reader_from_before_version_4_misses_a_sealed_layered_record(
    tmp_path: Path, monkeypatch
) -> None:
    """Run the record reader of the commit before sealed layered records on one: it refuses
    the head as a record of an unknown format (RejectedRecord: a miss, left in place), where
    reading the nonce and tag as body bytes would have been corrupt or worse."""
    repo = Path(__file__).resolve().parents[2]
    try:
        source = subprocess.run(
            ["git", "-C", str(repo), "show", f"{BEFORE_VERSION_4}:src/kvtier/tiers/record.py"],
            check=True,
            capture_output=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("no git history to take the older reader from")
    # the old reader's logic as it was; its imports of vocabulary that moved since, where it is now
    for moved, now in (
        (b"kvtier.tiers.vocab", b"kvtier.vocab"),
        (b"kvtier.plan.units", b"kvtier.units"),
    ):
        source = source.replace(moved, now)
    path = tmp_path / "record_before_v4.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("record_before_v4", path)
    old = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, old)  # its dataclasses look themselves up
    spec.loader.exec_module(old)
    tier = DiskTier(tmp_path / "d", 64 << 20, layered=True, **keyed("sealed"))
    tier.put(b"k", Payload.of(chunk(15)), namespace="ns")
    loc = tier._index[("ns", b"k")]
    with open(loc.segment.path, "rb") as f:
        f.seek(loc.offset)
        raw = f.read(loc.head.record_len)
    tier.close()
    with pytest.raises(RejectedRecord, match="unknown format"):
        old.head_len(raw)
    with pytest.raises(RejectedRecord, match="unknown format"):
        old.parse_head(raw)
