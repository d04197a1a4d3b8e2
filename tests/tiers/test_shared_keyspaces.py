"""Replicas with another master key or another protection mode share one redis-server with
the others: each reads, writes, evicts and deletes only the values of its own key and mode, so
a misconfigured replica costs its own requests a recompute and nobody else anything.

Every test runs against a real redis-server on loopback (conftest.py) and compares the bytes
the server holds before and after."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import redis

from kvtier.tiers import HostTier, Payload, RedisTier, Sealer, Signer, TieredStore
from kvtier.tiers.record import parse_head

MODES = ("none", "signed", "sealed")
KEY, OTHER_KEY = bytes(range(32)), bytes(range(32, 64))
BLOCKS = [bytes([i]) * 8 for i in range(12)]  # six chunks of two blocks
CHUNK_BYTES = 16384  # make_payload()
NAMESPACE = "acme"


def protection(mode: str, key: bytes) -> dict[str, object]:
    if mode == "signed":
        return {"signer": Signer(key)}
    return {"sealer": Sealer(key)} if mode == "sealed" else {}


def foreign_pairs() -> Iterator[tuple[str, str, bytes]]:
    """(writer's mode, reader's mode, reader's key; the writer's is KEY) for every reader that
    cannot verify the writer's values: another mode, or the same keyed mode with another key.
    A key matters only where both sides have one."""
    for writer in MODES:
        for reader in MODES:
            keys = (KEY, OTHER_KEY) if "none" not in (writer, reader) else (KEY,)
            for key in keys:
                if writer != reader or key != KEY:
                    yield writer, reader, key


FOREIGN = pytest.mark.parametrize(
    "writer, reader, reader_key",
    list(foreign_pairs()),
    ids=[f"{w}-{r}-{'same' if k == KEY else 'other'}-key" for w, r, k in foreign_pairs()],
)


def replica(url: str, mode: str, key: bytes, remote_bytes: int = 1 << 22) -> TieredStore:
    """A replica's store: a host tier over the shared remote tier."""
    host = HostTier(1 << 20, slot_bytes=CHUNK_BYTES)
    remote = RedisTier(url, remote_bytes, timeout_s=5.0, **protection(mode, key))
    return TieredStore([host, remote], block_tokens=16, chunk_tokens=32)


def server_values(url: str) -> dict[bytes, bytes]:
    with redis.Redis.from_url(url) as client:
        return {rkey: client.get(rkey) for rkey in client.scan_iter(count=1000)}


def damage(before: dict[bytes, bytes], after: dict[bytes, bytes]) -> tuple[int, int]:
    """(overwritten, deleted) among the values `before` held."""
    overwritten = sum(1 for k, v in before.items() if k in after and after[k] != v)
    return overwritten, sum(1 for k in before if k not in after)


def write_shared_values(
    url: str, mode: str, make_payload: Callable[..., Payload]
) -> tuple[TieredStore, dict[bytes, Payload]]:
    writer = replica(url, mode, KEY)
    payloads = {}
    for index, chunk in enumerate(writer.chunks(BLOCKS, NAMESPACE)):
        payloads[chunk.id] = make_payload(seed=index)
        assert writer.put(chunk, payloads[chunk.id], tier="remote")
    return writer, payloads


def run_the_other_replica(store: TieredStore, payloads: dict[bytes, Payload]) -> list[bool]:
    """What the engine makes a replica do with a conversation another one wrote: look the
    chunks up, restore what it can, and store what it recomputed, half with write-through
    (straight to the remote tier), half through its host tier (demoted to the remote tier)."""
    store.discover(BLOCKS, NAMESPACE, deadline_s=30)
    restored = []
    for index, chunk in enumerate(store.chunks(BLOCKS, NAMESPACE)):
        loaded = store.promote(chunk.id)
        restored.append(loaded is not None)
        if index % 2:
            store.put(chunk, payloads[chunk.id], tier="remote")
        else:
            store.put(chunk, payloads[chunk.id])
            store.demote(chunk.id)
    return restored


@FOREIGN
def test_a_replica_with_another_key_or_mode_leaves_the_shared_values_alone(
    redis_url: str, make_payload, same, writer: str, reader: str, reader_key: bytes
) -> None:
    _, payloads = write_shared_values(redis_url, writer, make_payload)
    before = server_values(redis_url)
    assert len(before) == len(payloads)

    # Its remote budget holds two of its chunks, well below what the server holds: its
    # budget counts and evicts its own values only.
    stranger = replica(redis_url, reader, reader_key, remote_bytes=5 * CHUNK_BYTES // 2)
    restored = run_the_other_replica(stranger, payloads)
    after = server_values(redis_url)
    assert damage(before, after) == (0, 0)
    assert restored == [False] * len(payloads)
    assert stranger.snapshot()["discovered"] == 0
    # its own writes went to its own keyspace (and it serves them to itself)
    assert 0 < len(after) - len(before) <= 2
    assert sum(same(stranger.promote(cid), p) for cid, p in payloads.items()) == len(after) - 6

    # a replica with the writer's key and mode still restores every chunk
    owner = replica(redis_url, writer, KEY)
    assert owner.discover(BLOCKS, NAMESPACE, deadline_s=30) == len(payloads)
    assert all(same(owner.promote(cid), payload) for cid, payload in payloads.items())


@pytest.mark.parametrize("mode", MODES)
def test_replicas_with_the_same_key_and_mode_share_the_values(
    redis_url: str, make_payload, same, mode: str
) -> None:
    _, payloads = write_shared_values(redis_url, mode, make_payload)
    peer = replica(redis_url, mode, KEY)
    assert run_the_other_replica(peer, payloads) == [True] * len(payloads)
    assert peer.snapshot()["discovered"] == len(payloads)

    owner = replica(redis_url, mode, KEY)  # what the peer wrote again serves the others
    assert owner.discover(BLOCKS, NAMESPACE, deadline_s=30) == len(payloads)
    assert all(same(owner.promote(cid), payload) for cid, payload in payloads.items())


def test_each_key_and_mode_has_a_keyspace_named_in_the_redis_key_and_the_record(
    redis_url: str, make_payload
) -> None:
    key_id = Signer(KEY).key_id
    assert len(key_id) == 8  # 64 bits: two master keys share one with odds of 2**-64
    assert Sealer(KEY).key_id == key_id != Signer(OTHER_KEY).key_id  # one id per master key
    tiers = {
        (mode, key): RedisTier(redis_url, 1 << 20, **protection(mode, key))
        for mode in MODES
        for key in (KEY, OTHER_KEY)
    }
    names = {(mode, key): tier.redis_key(b"k", "t") for (mode, key), tier in tiers.items()}
    assert names[("none", KEY)] == names[("none", OTHER_KEY)] == b"kvt:none:t:6b"  # b"k".hex()
    assert names[("signed", KEY)] == b"kvt:signed-" + key_id.hex().encode() + b":t:6b"
    assert len({names[pair] for pair in names if pair[0] != "none"}) == 4

    for (mode, key), tier in tiers.items():
        assert tier.put(b"k", make_payload(), namespace="t")
        with redis.Redis.from_url(redis_url) as client:
            head = parse_head(client.get(names[(mode, key)]))
        assert head.key_id == (b"" if mode == "none" else Signer(key).key_id)
        tier.close()


@FOREIGN
def test_a_value_of_another_key_or_mode_under_this_tier_s_name_is_never_replaced(
    redis_url: str, make_payload, same, writer: str, reader: str, reader_key: bytes
) -> None:
    """A value that another key or mode wrote, copied under this tier's name (a prefix set
    by hand, an attacker): this tier finds no entry in it, misses it, refuses to write over
    it, and neither counts nor evicts it, even over budget."""
    theirs = RedisTier(redis_url, 1 << 20, **protection(writer, KEY))
    assert theirs.put(b"k", make_payload(seed=1), namespace="t")
    mine = RedisTier(redis_url, 5 * CHUNK_BYTES // 2, **protection(reader, reader_key))
    assert mine.put(b"own", make_payload(seed=2), namespace="t")
    name = mine.redis_key(b"k", "t")
    with redis.Redis.from_url(redis_url) as client:
        planted = client.get(theirs.redis_key(b"k", "t"))
        client.set(name, planted)

    assert mine.find([b"k"], namespace="t") == [None]
    assert mine.get(b"k", namespace="t") is None
    assert not mine.put(b"k", make_payload(seed=3), namespace="t")
    assert mine.stats.rejected == 2
    recounted = RedisTier(redis_url, CHUNK_BYTES, **protection(reader, reader_key))
    assert [entry.key for entry in recounted.entries()] == []  # its own value is over budget
    with redis.Redis.from_url(redis_url) as client:
        assert client.get(name) == planted
    for tier in (theirs, mine, recounted):
        tier.close()


@pytest.mark.parametrize("there", ["a peer's value", "damage"])
def test_a_peer_s_value_or_damage_under_this_tier_s_name_is_written_over(
    redis_url: str, make_payload, same, there: str
) -> None:
    """What a peer with the same key and mode wrote under a name this tier has not counted
    is the same chunk (keys are content addresses), and a value every reader sees is damaged
    (a failed checksum) is nobody's: a put replaces either."""
    tier = RedisTier(redis_url, 1 << 20, signer=Signer(KEY))
    assert tier.entries() == []  # counted before the peer writes
    peer = RedisTier(redis_url, 1 << 20, signer=Signer(KEY))
    assert peer.put(b"k", make_payload(seed=1), namespace="t")
    name = tier.redis_key(b"k", "t")
    if there == "damage":
        with redis.Redis.from_url(redis_url) as client:
            value = bytearray(client.get(name))
            value[-1] ^= 0x01
            client.set(name, bytes(value))
    payload = make_payload(seed=2)
    assert tier.put(b"k", payload, namespace="t")
    assert same(tier.get(b"k", namespace="t"), payload)
    assert same(peer.get(b"k", namespace="t"), payload)
    assert tier.stats.errors == 0
    for each in (tier, peer):
        each.close()


def test_a_failed_read_from_the_shared_tier_forgets_the_chunk_and_deletes_nothing(
    redis_url: str, make_payload
) -> None:
    """The store forgets a chunk whose read failed; from a shared tier it deletes nothing, as
    it would from its own disk: what fails this reader's check may be another's to serve, and
    damage that every reader sees the tier deletes on its read already."""
    store = replica(redis_url, "signed", KEY)
    (chunk,) = store.chunks(BLOCKS[:2], NAMESPACE)
    assert store.put(chunk, make_payload(seed=1), tier="remote")
    theirs = RedisTier(redis_url, 1 << 20, signer=Signer(OTHER_KEY))
    assert theirs.put(chunk.id, make_payload(seed=2), namespace=NAMESPACE)
    name = store.tiers["remote"].redis_key(chunk.id, NAMESPACE)
    with redis.Redis.from_url(redis_url) as client:
        planted = client.get(theirs.redis_key(chunk.id, NAMESPACE))
        client.set(name, planted)

    assert store.promote(chunk.id) is None and store.locate(chunk.id) is None
    with redis.Redis.from_url(redis_url) as client:
        assert client.get(name) == planted
    theirs.close()
