"""Real model, real tiers: a resumed prompt whose stored history has a hole (a chunk the
policy dropped) or whose restore plan recomputes the front loads the chunks after the
recomputed run when the prefill reaches them, with greedy output identical to recomputing."""

from __future__ import annotations

import pytest

from kvtier.cache import TiersConfig
from kvtier.cache.setup import attach_connector
from kvtier.policy.actions import Move
from kvtier.policy.config import PolicyConfig
from kvtier.policy.cost_model import CostProfile, TierLink
from kvtier.tiers import Chunk

from .scenario import GREEDY, assert_no_leak, drain, make_turns, run_first_and_flood, run_second

pytestmark = pytest.mark.slow

MIB = 1 << 20


def session_chunks(connector, session: str = "s1") -> list[Chunk]:
    remembered = connector.runner.sessions[session]
    return [Chunk(keys, remembered.namespace) for keys in connector.chunk_keys(remembered.keys)]


def test_chunks_after_a_hole_are_loaded(engine, expected, tmp_path):
    turns = make_turns(0)
    _first_ref, second_ref = expected
    tiers = TiersConfig(host_bytes=64 * MIB, chunk_tokens=32)
    connector = attach_connector(engine, tiers, "offload")
    first = run_first_and_flood(engine, turns)
    assert connector.flush(timeout=30)
    chunks = session_chunks(connector)
    stored = [chunk for chunk in chunks if connector.store.locate(chunk.id) is not None]
    assert len(stored) >= 3, "the flood pushed at least 3 chunks of turn 1 into the host tier"
    hole, after = stored[0], stored[1:]
    assert chunks[chunks.index(hole) + 1 :] == after
    connector.store.delete(hole.id)  # as a policy dropping that chunk would
    second, out = run_second(engine, turns, first)

    assert second == second_ref
    sources = out.metrics.prompt_token_sources
    # the hole recomputed (but for blocks still on the device), the chunks after it loaded
    after_hole = sum(len(chunk.keys) for chunk in after)
    assert connector.counters["restored_blocks_after_recompute"] == after_hole
    assert sources["host"] == after_hole * 16
    assert sources["recomputed"] > len(turns.extra)
    assert sum(sources.values()) == len(turns.second(first))
    assert engine.stats().tiers["tokens"]["host"] == sources["host"]
    assert_no_leak(engine)


def test_bidirectional_plan_recomputes_the_front_and_loads_the_back(engine, expected, tmp_path):
    turns = make_turns(0)
    _first_ref, second_ref = expected
    # a link slow enough that loading everything loses to recomputing the cheap leading
    # chunks while the later ones load: the planner's bidirectional case
    profile = CostProfile(
        prefill_fixed_s=0.0,
        prefill_token_s=1e-4,
        prefill_pair_s=2e-6,
        links={"host": TierLink(bandwidth=1e8)},
    )
    tiers = TiersConfig(host_bytes=64 * MIB, chunk_tokens=64, restore="plan", cost_profile=profile)
    connector = attach_connector(engine, tiers, "offload", PolicyConfig())
    first = run_first_and_flood(engine, turns)
    assert connector.flush(timeout=30)

    second, out = run_second(engine, turns, first)

    assert second == second_ref
    assert connector.counters["restore_plan_bidirectional"] == 1
    sources = out.metrics.prompt_token_sources
    assert sources["host"] > 0 and connector.counters["restored_blocks_after_recompute"] > 0
    assert sources["recomputed"] >= 16 + len(turns.extra)  # the front, then the new tokens
    assert sum(sources.values()) == len(turns.second(first))
    assert_no_leak(engine)


def first_turn_in_32_token_chunks(engine, policy: str):
    """Session s1's first turn with a host tier and 32-token chunks, its KV left on the
    device: the turns, the connector, the first answer."""
    turns = make_turns(0)
    tiers = TiersConfig(host_bytes=64 * MIB, chunk_tokens=32)
    connector = attach_connector(engine, tiers, policy)
    rid = engine.add_request(turns.first, GREEDY, session_id="s1")
    return turns, connector, drain(engine)[rid]


def test_blocks_still_on_the_device_after_a_hole_are_taken_not_recomputed(engine, expected):
    """Chunk 0 dropped, chunk 1 moved to host, chunks 2-4 still cached on the device: the
    prefill recomputes chunk 0, loads chunk 1, then takes the cached blocks as they are (the
    prefix lookup alone stops at the first missing block)."""
    turns, connector, first = first_turn_in_32_token_chunks(engine, "offload")
    second_ref = expected[1]
    chunks = session_chunks(connector)  # 9 full blocks of turn 1: chunks of 2, 2, 2, 2, 1
    assert [len(chunk.keys) for chunk in chunks] == [2, 2, 2, 2, 1]
    connector.drop_device_blocks(chunks[0].keys)
    connector.runner.execute(Move("s1", 1, "host"))
    assert connector.flush(timeout=30)
    assert connector.store.locate(chunks[1].id).tier == "host"

    second, out = run_second(engine, turns, first)

    assert second == second_ref
    sources = out.metrics.prompt_token_sources
    new_tokens = len(turns.second(first)) - 9 * 16
    assert (sources["device"], sources["host"]) == (5 * 16, 2 * 16)
    assert sources["recomputed"] == 2 * 16 + new_tokens
    assert connector.counters["reused_device_blocks_after_recompute"] == 5
    assert_no_leak(engine)


def test_with_nothing_stored_retain_takes_the_blocks_after_a_dropped_front(engine, expected):
    """retain stores nothing; its pressure drops take a session's front chunk first. The rest
    of the session, still on the device, is taken once the prefill has recomputed the front."""
    turns, connector, first = first_turn_in_32_token_chunks(engine, "retain")
    second_ref = expected[1]
    connector.drop_device_blocks(session_chunks(connector)[0].keys)
    assert len(connector.store) == 0

    second, out = run_second(engine, turns, first)

    assert second == second_ref
    sources = out.metrics.prompt_token_sources
    assert (sources["device"], sources["recomputed"]) == (7 * 16, len(turns.second(first)) - 7 * 16)
    assert_no_leak(engine)
