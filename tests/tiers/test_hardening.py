"""Fault injection for the tiers (issue #18): outages, wrong keys, forgeries, damaged disks.

Every test runs the real component: redis-server processes on loopback (conftest.py), real
segment files in tmp_path. Whatever is injected, a tier answers a miss or the exact bytes put,
never other bytes, never an exception, and one reader's mistake never destroys what other
readers can use.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvtier.tiers import Payload, RedisTier
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
    assert same(tier.get(keys[0]), payload)  # the tier works again
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unreachable" in warnings[0]
    back = [r for r in caplog.records if r.getMessage().endswith("is back")]
    assert len(back) == 1 and back[0].levelno == logging.INFO
    tier.close()
