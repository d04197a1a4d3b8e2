"""Fault injection for the tiers (issue #18): outages, wrong keys, forgeries, damaged disks.

Every test runs the real component: redis-server processes on loopback (conftest.py), real
segment files in tmp_path. Whatever is injected, a tier answers a miss or the exact bytes put,
never other bytes, never an exception, and one reader's mistake never destroys what other
readers can use.
"""

from __future__ import annotations

import bisect
import logging
import os
import random
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.cache.config import TiersConfig
from kvtier.errors import KvtierError
from kvtier.tiers import DiskTier, Payload, RedisTier, Sealer, Signer
from kvtier.tiers.record import RecordHead, encode_head, parse_head
from kvtier.tiers.segment import HEADER_BYTES, Segment
from tests.tiers.conftest import RedisServer


def wait_until(condition: Callable[[], bool], what: str, limit_s: float = 30.0) -> None:
    """Poll until `condition` holds; the limit only turns a hang into a failure."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


# -- 1. a Redis outage under concurrent traffic -------------------------------------------


def test_an_outage_under_concurrent_traffic_is_one_warning_and_misses(
    own_redis: RedisServer, make_payload: Callable[..., Payload], same, caplog
) -> None:
    tier = RedisTier(own_redis.url, 64 << 20, timeout_s=0.5, retry_after_s=(0.05, 0.1))
    payload = make_payload(tokens=64)
    keys = [bytes([i]) * 16 for i in range(6)]
    assert tier.put_many([(key, payload) for key in keys]) == [True] * 6
    caplog.set_level(logging.DEBUG, logger="kvtier.tiers")
    caplog.clear()
    stop = threading.Event()
    served: list[Payload | None] = []

    def traffic(key: bytes) -> None:
        # What a mover's spill and prefetch workers do: puts and gets on the shared client.
        while not stop.is_set():
            tier.put(key, payload)
            served.append(tier.get(key))

    threads = [threading.Thread(target=traffic, args=(key,)) for key in keys]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: tier.stats.hits >= 30, "traffic before the outage")
        own_redis.stop()
        errors = tier.stats.errors
        wait_until(lambda: tier.stats.errors >= errors + 60, "failed calls during the outage")
        assert tier.get(keys[0]) is None  # down: a miss
        own_redis.start()  # same port, empty
        hits = tier.stats.hits
        wait_until(lambda: tier.stats.hits >= hits + 30, "traffic after the restart")
    finally:
        stop.set()
        for thread in threads:
            thread.join()

    assert all(got is None or same(got, payload) for got in served)
    assert tier.stats.corrupt == tier.stats.rejected == 0  # no reply was mixed up either
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unreachable" in warnings[0]
    back = [r for r in caplog.records if r.getMessage().endswith("is back")]
    assert len(back) == 1 and back[0].levelno == logging.INFO
    assert tier.put(keys[0], payload)  # the tier works again
    assert same(tier.get(keys[0]), payload)
    tier.close()


# -- 2-4. keys: wrong readers, forgers, records moved between names ------------------------

MASTER, OTHER_MASTER = os.urandom(32), os.urandom(32)
PROTECTIONS: dict[str, Callable[[bytes], dict[str, object]]] = {
    "sealed": lambda master: {"sealer": Sealer(master)},
    "signed": lambda master: {"signer": Signer(master)},
    "plain": lambda master: {},
}


def rewrite(
    value: bytes,
    *,
    key: bytes | None = None,
    namespace: str | None = None,
    body: bytes | None = None,
) -> bytes:
    """What anyone who can write to Redis can do without a master key: edit a record and
    recompute its unkeyed checksums (head and body xxh3), keeping whatever signature (and key
    id) it had."""
    head = parse_head(value)
    body = value[head.head_len :] if body is None else body
    namespace = head.namespace if namespace is None else namespace
    new_head = encode_head(
        key or head.key,
        namespace,
        head.meta,
        body,
        head.flags,
        head.written_at,
        head.mac,
        key_id=head.key_id,
    )
    return new_head + body


@pytest.mark.parametrize(
    "writer, reader",
    [
        ("sealed", "sealed"),  # the reader has another master key
        ("signed", "signed"),  # likewise
        ("sealed", "plain"),  # the reader has no key at all
        ("signed", "sealed"),  # the reader protects its own values otherwise
        ("plain", "signed"),
    ],
)
def test_a_misconfigured_reader_misses_and_leaves_shared_values_alone(
    redis_url: str, make_payload: Callable[..., Payload], same, writer: str, reader: str
) -> None:
    """Each key and mode reads under names of its own (test_shared_keyspaces.py), so the
    owner's value is copied under the stranger's name here, as a hand-set prefix or an
    attacker could put it."""
    payload = make_payload()
    owner = RedisTier(redis_url, 8 << 20, **PROTECTIONS[writer](MASTER))
    stranger = RedisTier(redis_url, 8 << 20, **PROTECTIONS[reader](OTHER_MASTER))
    assert owner.put(b"k", payload, namespace="tenant")
    rkey = stranger.redis_key(b"k", "tenant")
    with redis.Redis.from_url(redis_url) as client:
        client.set(rkey, client.get(owner.redis_key(b"k", "tenant")))

    assert stranger.get(b"k", namespace="tenant") is None
    assert (stranger.stats.rejected, stranger.stats.corrupt, stranger.stats.errors) == (1, 0, 1)
    with redis.Redis.from_url(redis_url) as client:
        assert client.exists(rkey)  # still there for everyone else
    assert same(owner.get(b"k", namespace="tenant"), payload)

    # Damage any reader can see (the checksum of the bytes as stored) is deleted, by anyone.
    with redis.Redis.from_url(redis_url) as client:
        value = bytearray(client.get(rkey))
        value[-10] ^= 0x01
        client.set(rkey, bytes(value))
    assert stranger.get(b"k", namespace="tenant") is None
    assert (stranger.stats.rejected, stranger.stats.corrupt, stranger.stats.errors) == (1, 1, 2)
    with redis.Redis.from_url(redis_url) as client:
        assert not client.exists(rkey)
    assert same(owner.get(b"k", namespace="tenant"), payload)  # the owner's own is untouched
    owner.close()
    stranger.close()


def test_a_cut_or_unparseable_value_is_deleted_as_corrupt(
    redis_url: str, make_payload: Callable[..., Payload]
) -> None:
    tier = RedisTier(redis_url, 8 << 20, signer=Signer(MASTER))
    tier.put_many([(b"cut", make_payload()), (b"junk", make_payload())])
    with redis.Redis.from_url(redis_url) as client:
        cut, junk = tier.redis_key(b"cut", ""), tier.redis_key(b"junk", "")
        client.set(cut, client.get(cut)[:-1])
        client.set(junk, b"not a record at all")
        assert tier.get_many([b"cut", b"junk"]) == [None, None]
        assert tier.stats.corrupt == 2 and tier.stats.rejected == 0
        assert not client.exists(cut) and not client.exists(junk)
    tier.close()


@pytest.mark.parametrize("protection", ["signed", "sealed"])
def test_a_forged_value_is_a_miss_never_the_forged_bytes(
    redis_url: str, make_payload: Callable[..., Payload], same, protection: str
) -> None:
    payload, forged = make_payload(seed=1), make_payload(seed=2)  # same shape, other bytes
    assert forged.data is not None
    tier = RedisTier(redis_url, 8 << 20, **PROTECTIONS[protection](MASTER))
    assert tier.put(b"k", payload, namespace="tenant")
    rkey = tier.redis_key(b"k", "tenant")
    with redis.Redis.from_url(redis_url) as client:
        value = client.get(rkey)
        client.set(rkey, rewrite(value, body=bytes(forged.data.numpy()) + bytes(28)))
        assert tier.get(b"k", namespace="tenant") is None  # the sealed size: 28 bytes more
        client.set(rkey, rewrite(value, body=bytes(forged.data.numpy())))
        assert tier.get(b"k", namespace="tenant") is None
        # Stripping the protection does not help: a tier with a key serves only its kind.
        plain = RedisTier(redis_url, 8 << 20)
        assert plain.put(b"k", forged, namespace="tenant")
        client.set(rkey, client.get(plain.redis_key(b"k", "tenant")))
        plain.close()
        assert tier.get(b"k", namespace="tenant") is None
        assert client.exists(rkey)  # a forgery is not damage: it stays (its writer could
        # write it again anyway) and costs a miss each time
    assert tier.stats.rejected == 3 and tier.stats.corrupt == 0 and tier.stats.hits == 0
    tier.close()


def test_without_a_key_a_forgery_is_served_and_the_tier_says_so_at_start(
    redis_url: str, make_payload: Callable[..., Payload], same, caplog
) -> None:
    """The trade-off of the default without a key (docs/storage-format.md, Threat model)."""
    payload, forged = make_payload(seed=1), make_payload(seed=2)
    assert forged.data is not None
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers"):
        tier = RedisTier(redis_url, 8 << 20)
    assert [r for r in caplog.records if "neither signed nor sealed" in r.getMessage()]
    assert tier.put(b"k", payload)
    with redis.Redis.from_url(redis_url) as client:
        rkey = tier.redis_key(b"k", "")
        client.set(rkey, rewrite(client.get(rkey), body=bytes(forged.data.numpy())))
    assert same(tier.get(b"k"), forged)
    tier.close()


@pytest.mark.parametrize("protection", ["signed", "sealed"])
@pytest.mark.parametrize("move", ["another key", "another namespace"])
def test_a_valid_value_moved_under_another_name_is_rejected(
    redis_url: str, make_payload: Callable[..., Payload], same, protection: str, move: str
) -> None:
    """The signature (or the AEAD) covers the key and the namespace: a record copied under
    another name, its head rewritten to match and its checksums recomputed, does not verify."""
    tier = RedisTier(redis_url, 8 << 20, **PROTECTIONS[protection](MASTER))
    payload = make_payload()
    assert tier.put(b"victim", payload, namespace="tenant")
    to_key, to_namespace = (b"other", "tenant") if move == "another key" else (b"victim", "mallory")
    with redis.Redis.from_url(redis_url) as client:
        value = client.get(tier.redis_key(b"victim", "tenant"))
        moved = rewrite(value, key=to_key, namespace=to_namespace)
        client.set(tier.redis_key(to_key, to_namespace), moved)
    assert tier.get(to_key, namespace=to_namespace) is None
    assert tier.stats.rejected == 1
    assert same(tier.get(b"victim", namespace="tenant"), payload)  # the original still serves
    tier.close()


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "o_direct"])
def test_a_signed_disk_tier_round_trips_and_rejects_another_key(
    tmp_path: Path, make_payload: Callable[..., Payload], same, direct: bool
) -> None:
    payload = make_payload(tokens=64)
    tier = DiskTier(tmp_path, 1 << 20, persist=True, direct=direct, signer=Signer(MASTER))
    assert tier.put(b"k", payload, namespace="t")
    assert same(tier.get(b"k", namespace="t"), payload)
    tier.close()
    reopened = DiskTier(tmp_path, 1 << 20, persist=True, direct=direct, signer=Signer(MASTER))
    assert same(reopened.get(b"k", namespace="t"), payload)
    reopened.close()
    stranger = DiskTier(tmp_path, 1 << 20, persist=True, signer=Signer(OTHER_MASTER))
    assert stranger.get(b"k", namespace="t") is None and stranger.stats.rejected == 1
    stranger.close()


def test_the_remote_tier_signs_by_default_when_a_key_is_configured() -> None:
    remote = {"host_bytes": 1 << 20, "redis_url": "redis://127.0.0.1:1/0"}
    assert TiersConfig(**remote).remote_integrity() == "none"
    assert TiersConfig(**remote, encrypt_key=MASTER).remote_integrity() == "mac"
    assert TiersConfig(**remote, encrypt=True).remote_integrity() == "encrypt"
    assert TiersConfig(**remote, encrypt_key=MASTER, integrity="none").remote_integrity() == "none"
    with pytest.raises(KvtierError, match=r"needs tiers\.encrypt_key"):
        TiersConfig(**remote, integrity="mac")
    with pytest.raises(KvtierError, match="contradicts"):
        TiersConfig(**remote, encrypt=True, integrity="none")
    with pytest.raises(KvtierError, match="mac, encrypt or none"):
        TiersConfig(**remote, integrity="hmac")  # type: ignore[arg-type]


# -- 5. a damaged disk segment ----------------------------------------------------------------


def only_segment(directory: Path) -> Path:
    (path,) = sorted(directory.glob("*.seg"))
    return path


def intact_records(path: Path) -> list[tuple[int, RecordHead]]:
    """The records of an undamaged segment file, as the start-up scan lists them."""
    opened = Segment.open_existing(path, direct=False)
    assert opened is not None
    segment, records = opened
    segment.close()
    return records


@pytest.mark.parametrize("where", ["head", "body"])
def test_a_zeroed_region_mid_segment_costs_only_the_records_it_hits(
    tmp_path: Path, make_payload: Callable[..., Payload], same, where: str
) -> None:
    a, b, c = (make_payload(seed=i) for i in range(3))
    tier = DiskTier(tmp_path, 1 << 20, persist=True)
    for key, payload in ((b"A", a), (b"B", b), (b"C", c)):
        assert tier.put(key, payload)
    tier.delete(b"B")  # a tombstone, after C
    tier.close()
    path = only_segment(tmp_path)
    offset, head = intact_records(path)[0]  # A
    start = offset if where == "head" else offset + head.head_len + 100
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(bytes(2000))

    again = DiskTier(tmp_path, 1 << 20, persist=True)
    assert again.get(b"A") is None
    assert same(again.get(b"C"), c)  # after the damage: still found
    assert not again.contains(b"B") and again.get(b"B") is None  # its tombstone still counts
    assert again.put(b"D", a) and same(again.get(b"D"), a)
    again.close()
    assert path.stat().st_size > offset + head.record_len  # nothing after the damage was cut


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["put", "put", "delete"]), st.integers(0, 3)),
        min_size=1,
        max_size=12,
    ),
    damage=st.lists(
        st.tuples(
            st.floats(0, 1), st.integers(1, 3000), st.sampled_from(["zero", "flip", "random"])
        ),
        min_size=1,
        max_size=3,
    ),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_damage_never_yields_wrong_bytes_and_spares_intact_records(
    ops: list[tuple[str, int]], damage: list[tuple[float, int, str]], seed: int
) -> None:
    """Whatever is damaged after the segment header, a reopened tier serves for each key
    exactly what its last record with an intact head says: that record's bytes when its body
    is intact too, a miss when it is a tombstone or its body is damaged (or no head is left)."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as directory:
        tier = DiskTier(directory, 8 << 20, persist=True)
        for i, (op, key) in enumerate([("put", 0), *ops]):  # a put first: a segment exists
            if op == "put":
                tier.put(bytes([key]), Payload.of(torch.full((3000 + key,), i, dtype=torch.uint8)))
            else:
                tier.delete(bytes([key]))
        tier.close()
        path = only_segment(Path(directory))
        original = path.read_bytes()
        records = intact_records(path)
        damaged = bytearray(original)
        for where, length, kind in damage:
            start = HEADER_BYTES + int(where * (len(damaged) - HEADER_BYTES))
            end = min(len(damaged), start + length)
            for i in range(start, end):
                damaged[i] = {"zero": 0, "flip": damaged[i] ^ 0xFF}.get(kind, rng.randrange(256))
        path.write_bytes(damaged)
        changed = [i for i in range(len(original)) if original[i] != damaged[i]]

        def hit(lo: int, hi: int) -> bool:
            return bisect.bisect_left(changed, lo) < bisect.bisect_left(changed, hi)

        expected: dict[bytes, bytes | None] = {}
        for offset, head in records:
            if hit(offset, offset + head.head_len):
                continue  # not found by the scan
            body = (offset + head.head_len, offset + head.record_len)
            intact = not head.tombstone and not hit(*body)
            expected[head.key] = original[body[0] : body[1]] if intact else None

        again = DiskTier(directory, 8 << 20, persist=True)
        for key in range(4):
            got = again.get(bytes([key]))
            served = None if got is None or got.data is None else got.data.numpy().tobytes()
            assert served == expected.get(bytes([key]))
        again.close()
