"""Remote tier on a real redis-server: exact bytes, exact budget, and outages cost only misses."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest
import redis
import torch

from kvtier.tiers import Payload, RedisTier


def keys_on_server(url: str) -> dict[bytes, int]:
    """Every key under the default prefix and its budget weight (key + value bytes)."""
    with redis.Redis.from_url(url) as client:
        return {key: len(key) + client.strlen(key) for key in client.scan_iter(match=b"kvt:*")}


def test_round_trip_bf16_and_fp32_one_by_one_and_pipelined(redis_url, make_payload, same) -> None:
    tier = RedisTier(redis_url, 8 << 20)
    bf16, fp32 = make_payload(dtype=torch.bfloat16), make_payload(dtype=torch.float32, seed=1)
    assert tier.put(b"a" * 32, bf16, namespace="m1/t1")
    assert same(tier.get(b"a" * 32, namespace="m1/t1"), bf16)

    batch = [(bytes([i]) * 32, make_payload(seed=i)) for i in range(5)] + [(b"f" * 32, fp32)]
    assert tier.put_many(batch, namespace="m1/t1") == [True] * 6
    got = tier.get_many([key for key, _ in batch] + [b"missing"], namespace="m1/t1")
    assert all(same(g, p) for g, (_, p) in zip(got, batch, strict=False))
    assert got[-1] is None
    assert tier.stats.hits == 7 and tier.stats.misses == 1 and tier.stats.errors == 0
    tier.close()


def test_keys_carry_the_namespace_and_a_ttl(redis_url, make_payload) -> None:
    tier = RedisTier(redis_url, 8 << 20, prefix="kvt", ttl_s=60)
    tier.put(b"\x01\x02", make_payload(), namespace="tenant-a")
    # the keyspace of an unkeyed tier is "none" (docs/backends/redis.md, "Keyspaces")
    assert list(keys_on_server(redis_url)) == [b"kvt:none:tenant-a:0102"]
    assert tier.get(b"\x01\x02", namespace="tenant-b") is None  # another tenant: another key
    with redis.Redis.from_url(redis_url) as client:
        assert 0 < client.pttl(b"kvt:none:tenant-a:0102") <= 60_000
    tier.close()


def test_expired_keys_are_misses_and_leave_the_count(redis_url, make_payload) -> None:
    tier = RedisTier(redis_url, 8 << 20, ttl_s=0.2)
    tier.put(b"k", make_payload())
    time.sleep(0.3)
    assert tier.get(b"k") is None and tier.stats.errors == 0
    assert tier.used_bytes == 0
    tier.close()


def test_a_new_process_finds_the_values_and_the_exact_count(redis_url, make_payload, same) -> None:
    first = RedisTier(redis_url, 8 << 20)
    payloads = {bytes([i]) * 32: make_payload(seed=i) for i in range(4)}
    first.put_many(list(payloads.items()), namespace="t")
    first.close()

    second = RedisTier(redis_url, 8 << 20)
    entries = second.entries()
    assert {entry.key for entry in entries} == set(payloads)
    assert {entry.nbytes for entry in entries} == {16384}
    assert second.used_bytes == sum(keys_on_server(redis_url).values())
    for key, payload in payloads.items():
        assert same(second.get(key, namespace="t"), payload)
    second.close()


def test_corrupt_or_moved_values_are_misses_with_an_error(redis_url, make_payload, same) -> None:
    tier = RedisTier(redis_url, 8 << 20)
    good, bad = make_payload(seed=1), make_payload(seed=2)
    tier.put(b"good", good)
    tier.put(b"bad", bad)
    with redis.Redis.from_url(redis_url) as client:
        bad_key, good_key = tier.redis_key(b"bad", ""), tier.redis_key(b"good", "")
        value = bytearray(client.get(bad_key))
        value[-10] ^= 0x01
        client.set(bad_key, bytes(value))
        client.set(tier.redis_key(b"moved", ""), client.get(good_key))

    assert tier.get(b"bad") is None
    assert tier.get(b"moved") is None  # good bytes under the wrong name are not served
    assert tier.stats.errors == 2
    assert same(tier.get(b"good"), good)
    with redis.Redis.from_url(redis_url) as client:
        assert not client.exists(bad_key)  # removed: it would fail every time
    tier.close()


def test_budget_evicts_oldest_and_tells_the_store(redis_url, make_payload) -> None:
    capacity = 100 * 1024
    tier = RedisTier(redis_url, capacity)
    evicted: list[bytes] = []
    tier.on_evict = lambda key, namespace: evicted.append(key)
    for i in range(12):  # 16 KiB each: 6 fit
        assert tier.put(bytes([i]), make_payload(seed=i))
        assert tier.used_bytes == sum(keys_on_server(redis_url).values()) <= capacity
    assert evicted == [bytes([i]) for i in range(6)]
    assert tier.get(bytes([0])) is None and tier.get(bytes([11])) is not None
    tier.close()


def test_budget_can_refuse_instead(redis_url, make_payload) -> None:
    tier = RedisTier(redis_url, 40 * 1024, on_full="refuse")
    assert tier.put(b"1", make_payload()) and tier.put(b"2", make_payload())
    assert not tier.fits(16384)
    assert not tier.put(b"3", make_payload())
    assert tier.stats.refused == 1 and tier.get(b"1") is not None
    tier.close()


def test_a_smaller_budget_after_restart_is_enforced_at_once(redis_url, make_payload) -> None:
    big = RedisTier(redis_url, 1 << 20)
    big.put_many([(bytes([i]), make_payload(seed=i)) for i in range(8)])
    big.close()
    small = RedisTier(redis_url, 50 * 1024)
    assert len(small.entries()) == 3
    assert small.used_bytes == sum(keys_on_server(redis_url).values()) <= 50 * 1024
    small.close()


def test_a_frozen_server_costs_one_timeout_then_fails_fast(own_redis, make_payload, same) -> None:
    tier = RedisTier(own_redis.url, 8 << 20, timeout_s=0.2, retry_after_s=(0.5, 1.0))
    payload = make_payload()
    assert tier.put(b"k", payload)
    own_redis.pause()
    try:
        start = time.monotonic()
        assert tier.get(b"k") is None
        assert time.monotonic() - start < 0.6  # bounded by the socket timeout
        # in backoff: no network at all. A call that went to the frozen server would block
        # for the whole socket timeout, so each call must end well before it (a bound per
        # call, not on the total: a busy machine may delay the loop, not a single call by 0.2 s)
        durations = []
        for _ in range(20):
            start = time.monotonic()
            assert tier.get(b"k") is None
            durations.append(time.monotonic() - start)
        assert max(durations) < 0.2
        assert tier.stats.errors == 21
    finally:
        own_redis.resume()
    time.sleep(0.55)
    assert same(tier.get(b"k"), payload)  # reconnected after the backoff
    tier.close()


def test_a_restarted_server_is_used_again(own_redis, make_payload, same) -> None:
    tier = RedisTier(own_redis.url, 8 << 20, timeout_s=0.2, retry_after_s=(0.1, 0.2))
    payload = make_payload()
    assert tier.put(b"before", payload)
    own_redis.stop()
    start = time.monotonic()
    assert tier.get(b"before") is None
    assert not tier.put(b"during", payload)
    assert time.monotonic() - start < 0.5
    own_redis.start()  # same port, empty (no persistence)
    time.sleep(0.25)
    assert tier.get(b"before") is None  # the data died with the server: a miss, not an error
    assert tier.put(b"after", payload)
    assert same(tier.get(b"after"), payload)
    assert tier.used_bytes == sum(keys_on_server(own_redis.url).values())  # recounted
    tier.close()


def test_redis_cluster_with_pipelines_across_slots(spawn_redis, make_payload, same) -> None:
    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli is not installed (it comes with redis-server's packages)")
    nodes = [
        spawn_redis("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
        for _ in range(3)
    ]
    create = subprocess.run(
        [
            "redis-cli",
            "--cluster",
            "create",
            *[f"127.0.0.1:{n.port}" for n in nodes],
            "--cluster-replicas",
            "0",
            "--cluster-yes",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert create.returncode == 0, create.stdout + create.stderr
    # every node, not only the first: a node reports "ok" once it has its own slots, while the
    # others may not have learnt the slot map yet, and a write routed to one of them then fails
    deadline = time.monotonic() + 10
    for node in nodes:
        with redis.Redis(port=node.port) as client:
            while client.cluster("info")["cluster_state"] != "ok":
                assert time.monotonic() < deadline, "cluster did not become ready"
                time.sleep(0.1)

    payloads = [(bytes([i]) * 32, make_payload(seed=i)) for i in range(12)]
    for hash_tag in (False, True):
        # a generous timeout: this checks routing, and a loaded machine can stall a
        # pipeline across three fresh nodes past the default 0.25 s
        tier = RedisTier(
            nodes[0].url, 8 << 20, cluster=True, hash_tag=hash_tag, prefix="c", timeout_s=5.0
        )
        assert tier.put_many(payloads, namespace="t") == [True] * 12
        got = tier.get_many([key for key, _ in payloads], namespace="t")
        assert all(same(g, p) for g, (_, p) in zip(got, payloads, strict=True))
        tier.close()
        recount = RedisTier(
            nodes[1].url, 8 << 20, cluster=True, hash_tag=hash_tag, prefix="c", timeout_s=5.0
        )
        assert len(recount.entries()) == 12  # found on all nodes by one SCAN of the prefix
        recount.close()
    slots = set()
    with redis.cluster.RedisCluster(host="127.0.0.1", port=nodes[0].port) as cluster:
        for key in cluster.scan_iter(match=b"c:none:t:*"):
            slots.add(cluster.keyslot(key))
    assert len(slots) > 1  # without a hash tag the chunks spread over the cluster


@pytest.mark.parametrize("nbytes", [0, 1, 3 << 20])
def test_odd_sizes(redis_url, same, nbytes) -> None:
    tier = RedisTier(redis_url, 8 << 20)
    payload = Payload.of(torch.randint(0, 255, (nbytes,), dtype=torch.uint8), form="int4")
    assert tier.put(b"k", payload)
    assert same(tier.get(b"k"), payload)
    tier.close()
