"""Real model, real tiers: a request's `load_limit` bounds what the restore of its history
loads. A tier it does not allow, or chunks past its token cap, are recomputed, and the greedy
answer is the one recomputing everything gives."""

from __future__ import annotations

import pytest

from kvtier.cache import TiersConfig
from kvtier.cache.setup import attach_connector
from kvtier.load_limit import LoadLimit

from .scenario import GREEDY, assert_no_leak, make_turns, run_first_and_flood

pytestmark = pytest.mark.slow

MIB = 1 << 20
TIERS = TiersConfig(host_bytes=64 * MIB, chunk_tokens=32)


def resume(engine, turns, first, limit):
    rid = engine.add_request(turns.second(first), GREEDY, session_id="s1", load_limit=limit)
    final = None
    outs: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                outs.extend(out.new_token_ids)
                final = out if out.finished else final
    return outs, final.metrics.prompt_token_sources


@pytest.mark.parametrize(
    ("limit", "host_tokens"),
    [
        (LoadLimit(frozenset()), 0),  # `[]`: load nothing
        (LoadLimit(frozenset({"disk"})), 0),  # a tier that holds none of it
        (LoadLimit(max_tokens=40), 32),  # whole 32-token chunks under the cap
    ],
)
def test_a_request_loads_only_what_its_limit_allows(engine, expected, limit, host_tokens):
    turns = make_turns(0)
    _first_ref, second_ref = expected
    connector = attach_connector(engine, TIERS, "offload")
    first = run_first_and_flood(engine, turns)
    assert connector.flush(timeout=30)

    second, sources = resume(engine, turns, first, limit)

    assert second == second_ref
    assert sources["host"] == host_tokens
    assert connector.counters["restore_chunks_refused_by_request"] > 0
    assert sum(sources.values()) == len(turns.second(first))
    assert_no_leak(engine)


def test_a_request_that_allows_the_tier_loads_as_without_a_limit(engine, expected):
    turns = make_turns(0)
    _first_ref, second_ref = expected
    connector = attach_connector(engine, TIERS, "offload")
    first = run_first_and_flood(engine, turns)
    assert connector.flush(timeout=30)

    second, sources = resume(engine, turns, first, LoadLimit(frozenset({"host", "disk"})))

    assert second == second_ref
    assert sources["host"] >= 64
    assert connector.counters["restore_chunks_refused_by_request"] == 0
    assert_no_leak(engine)
