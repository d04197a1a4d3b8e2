"""Real model, real tiers: `TieredConnector.clear` (what vLLM's reset of the connector's
cache runs) drops every stored chunk, writes in flight included, and a resumed turn then
recomputes its history with the same answer."""

from __future__ import annotations

import pytest

from kvtier.cache import TiersConfig
from kvtier.cache.setup import attach_connector

from .scenario import assert_no_leak, make_turns, run_first_and_flood, run_second

pytestmark = pytest.mark.slow


def test_clear_drops_every_chunk_and_the_next_turn_recomputes(engine, expected, tmp_path):
    turns = make_turns(0)
    _first_ref, second_ref = expected
    tiers = TiersConfig(
        host_bytes=1 << 20, disk_dir=str(tmp_path / "kv"), disk_bytes=64 << 20, chunk_tokens=32
    )
    connector = attach_connector(engine, tiers, "offload")
    run_first = run_first_and_flood(engine, turns)
    assert connector.flush(timeout=30)
    stored = len(connector.store)
    assert stored > 0

    dropped = connector.clear()

    assert dropped >= stored and len(connector.store) == 0
    assert all(tier.used_bytes == 0 for tier in connector.store.tiers.values())
    assert connector.counters["cleared_chunks"] == dropped
    second, out = run_second(engine, turns, run_first)
    assert second == second_ref
    sources = out.metrics.prompt_token_sources
    assert sources["host"] == sources["disk"] == 0
    assert_no_leak(engine)
