"""Spills and prefetches run beside the engine, not in its steps.

A frozen redis-server (SIGSTOP) is the slow tier: a write or read sent to it waits until the
server is resumed, so whatever the engine finishes meanwhile provably did not wait for it.
"""

from __future__ import annotations

import time

import pytest

from kvtier.cache import TiersConfig
from kvtier.cache.setup import attach_connector

from .scenario import GREEDY, assert_no_leak, make_turns, run_first_and_flood, run_second

pytestmark = pytest.mark.slow


def remote_only(url: str, **options) -> TiersConfig:
    return TiersConfig(
        host_bytes=0, redis_url=url, redis_prefix="kvt-bg", chunk_tokens=64, **options
    )


def test_engine_steps_do_not_wait_for_spills(engine, expected, own_redis):
    turns = make_turns(0)
    first_ref, second_ref = expected
    # A 30 s timeout: a spill stays stuck on the frozen server until it is resumed.
    connector = attach_connector(engine, remote_only(own_redis.url, redis_timeout_s=30), "offload")
    own_redis.pause()
    try:
        first = run_first_and_flood(engine, turns)
        assert first == first_ref
        # The flood evicted turn 1's blocks and every step returned, yet no write has landed.
        assert connector.writes.in_flight > 0
        assert len(connector.store) == 0
        assert connector.counters["spilled_chunks"] == 0
        # A resumed turn does not wait for them either: it restores from the staged copies.
        second, out = run_second(engine, turns, first)
        assert second == second_ref
        assert connector.counters["restored_chunks_staged"] > 0
        assert out.metrics.prompt_token_sources["remote"] > 0
    finally:
        own_redis.resume()
    assert connector.flush(timeout=60)
    assert connector.counters["spilled_chunks"] > 0
    assert connector.counters["spill_failures"] == 0
    assert connector.store.snapshot()["tiers"]["remote"]["chunks"] > 0
    assert_no_leak(engine)


def test_prefetch_starts_when_the_request_is_queued(engine, expected, redis_url):
    turns = make_turns(0)
    _first_ref, second_ref = expected
    connector = attach_connector(engine, remote_only(redis_url), "offload")
    first = run_first_and_flood(engine, turns)
    assert connector.flush(timeout=30)
    engine.add_request(turns.second(first), GREEDY, session_id="s1")
    # queued, not yet scheduled: the loads are already on the prefetch workers
    assert engine.scheduler.waiting and connector.counters["prefetched_chunks"] > 0
    assert connector.mover.counts["prefetches"] == connector.counters["prefetched_chunks"]
    outs, final = {}, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                final = out
    assert outs[final.request_id] == second_ref
    assert connector.counters["restored_chunks_prefetched"] > 0
    assert final.metrics.prompt_token_sources["remote"] > 0
    assert_no_leak(engine)


def test_a_late_prefetch_is_abandoned_at_the_deadline(engine, expected, own_redis):
    turns = make_turns(0)
    _first_ref, second_ref = expected
    config = remote_only(own_redis.url, redis_timeout_s=30, restore_deadline_s=0.2)
    connector = attach_connector(engine, config, "offload")
    first = run_first_and_flood(engine, turns)
    assert connector.flush(timeout=30)
    assert len(connector.store) > 0
    own_redis.pause()
    try:
        start = time.monotonic()
        second, out = run_second(engine, turns, first)
        elapsed = time.monotonic() - start
        # Admission waited for the prefetch until the deadline, then recomputed; the loads
        # are still stuck on the frozen server (they would take up to the 30 s timeout).
        assert connector.counters["restore_late"] >= 1
        assert out.metrics.prompt_token_sources["remote"] == 0
        assert elapsed < 15
    finally:
        own_redis.resume()
    assert second == second_ref
    assert_no_leak(engine)
