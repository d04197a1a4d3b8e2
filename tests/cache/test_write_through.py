"""Write-through: a finished turn's full chunks are copied to the top tier right away, so
evicting or moving them later frees the device blocks with no copy."""

from __future__ import annotations

import random

import pytest

from kvtier.cache import TiersConfig
from kvtier.cache.setup import attach_connector
from kvtier.errors import KvtierError
from kvtier.policy.actions import Move
from kvtier.tiers import Chunk

from .scenario import GREEDY, Turns, assert_no_leak, drain, reference, run_second

pytestmark = pytest.mark.slow

MIB = 1 << 20
CHUNK_TOKENS = 64  # 4 blocks of 16 tokens


def aligned_turns() -> Turns:
    """A first turn whose computed KV is exactly two full chunks (121 prompt tokens + 8
    generated, the last one not yet computed: 128 tokens), so no partial tail is involved."""
    r = random.Random(1)
    ids = lambda n: [r.randrange(1000, 20000) for _ in range(n)]  # noqa: E731
    return Turns(first=ids(121), flood=ids(250), extra=ids(20))


@pytest.fixture(scope="module")
def expected(_engine) -> tuple[list[int], list[int]]:
    """(turn 1 output, turn 2 output) computed with no tiers."""
    attach_connector(_engine, None)
    turns = aligned_turns()
    rid = _engine.add_request(turns.first, GREEDY, session_id="s1")
    first = drain(_engine)[rid]
    return first, reference(_engine, turns, first)


def first_turn(engine, turns: Turns) -> list[int]:
    rid = engine.add_request(turns.first, GREEDY, session_id="s1")
    return drain(engine)[rid]


def session_chunks(connector) -> list[Chunk]:
    stored = connector.runner.sessions["s1"]
    return [Chunk(keys, stored.namespace) for keys in connector.chunk_keys(stored.keys)]


def on_device(connector, chunk: Chunk) -> bool:
    return all(connector.block_pool.lookup(key) is not None for key in chunk.keys)


def attach(engine, write_through: bool, policy: str = "offload"):
    tiers = TiersConfig(host_bytes=64 * MIB, chunk_tokens=CHUNK_TOKENS, write_through=write_through)
    return attach_connector(engine, tiers, policy)


def host_chunks(connector) -> int:
    return connector.store.snapshot()["tiers"]["host"]["chunks"]


@pytest.mark.parametrize("write_through", [True, False])
def test_finished_turn_is_in_host_while_its_blocks_stay_cached(engine, expected, write_through):
    turns = aligned_turns()
    connector = attach(engine, write_through)
    assert first_turn(engine, turns) == expected[0]
    assert connector.flush(timeout=30)
    chunks = session_chunks(connector)
    assert len(chunks) == 2
    assert all(len(c.keys) == connector.blocks_per_chunk for c in chunks)
    assert all(on_device(connector, c) for c in chunks)
    if write_through:
        assert [connector.locate(c.id) for c in chunks] == ["host", "host"]
        assert host_chunks(connector) == 2
        counters = connector.stats()["counters"]
        assert counters["written_through_chunks"] == 2
        assert counters["written_through_bytes"] == 8 * connector.bytes_per_block
    else:
        assert host_chunks(connector) == 0
        assert "written_through_chunks" not in connector.counters
    assert_no_leak(engine)


def written_through_session(engine):
    """Session s1's first turn run with write-through, its copies landed: the turns, the
    connector, the first answer and the session's chunks."""
    turns = aligned_turns()
    connector = attach(engine, write_through=True)
    first = first_turn(engine, turns)
    assert connector.flush(timeout=30)
    return turns, connector, first, session_chunks(connector)


def test_eviction_of_written_through_blocks_copies_nothing(engine, expected):
    turns, connector, first, chunks = written_through_session(engine)
    engine.add_request(turns.flood, GREEDY, session_id="flood")  # needs 17 of 22 blocks
    drain(engine)
    assert connector.flush(timeout=30)
    assert not on_device(connector, chunks[1])  # the pool evicted the tail chunk...
    assert connector.counters["spilled_bytes"] == 0  # ...and copied nothing out of it
    assert connector.counters["spill_failures"] == 0
    before = connector.counters["written_through_chunks"]
    second, out = run_second(engine, turns, first)
    assert out.metrics.prompt_token_sources["host"] > 0
    assert second == expected[1]
    assert connector.flush(timeout=30)
    # turn 2's full chunks were both found in host (one of them restored from there): the
    # only chunk it adds is its partial tail, which is not written
    assert connector.counters["written_through_chunks"] == before
    assert connector.counters["restored_blocks_host"] > 0
    assert_no_leak(engine)


def test_policy_move_of_written_through_session_only_frees_blocks(engine, expected):
    turns, connector, first, chunks = written_through_session(engine)
    connector.runner.execute(Move("s1", None, "host"))
    assert connector.flush(timeout=30)
    assert connector.runner.decisions["move"] == 1
    assert all(connector.block_pool.lookup(key) is None for c in chunks for key in c.keys)
    assert connector.counters["policy_moved_bytes_device->host"] == 0
    assert connector.store.snapshot()["moves"].get("caller->host", {}).get("ops") == 2
    second, out = run_second(engine, turns, first)
    assert out.metrics.prompt_token_sources["host"] == 128
    assert out.metrics.prompt_token_sources["device"] == 0
    assert second == expected[1]
    assert_no_leak(engine)


def test_retain_writes_nothing_through(engine, expected):
    turns = aligned_turns()
    connector = attach(engine, write_through=True, policy="retain")
    assert not connector.write_through  # retain never spills, so nothing is written through
    assert first_turn(engine, turns) == expected[0]
    assert connector.flush(timeout=30)
    assert host_chunks(connector) == 0
    assert connector.counters["written_through_chunks"] == 0
    assert_no_leak(engine)


def test_forgotten_blocks_are_not_spilled_when_evicted(engine):
    """An engine that never reports evictions (vLLM) drops a finished request's mapping
    with `Spiller.forget`; an eviction reported after that finds no chunk to spill."""
    turns = aligned_turns()
    connector = attach(engine, write_through=False)
    first_turn(engine, turns)
    keys = connector.runner.sessions["s1"].keys
    connector.spiller.forget(keys)
    for key in keys:
        connector.on_block_evicted(engine.block_pool.lookup(key), key)
    assert connector.flush(timeout=30)
    assert connector.stats()["counters"]["evicted_unknown"] == len(keys)
    assert host_chunks(connector) == 0


def test_selective_write_through_copies_only_what_a_prompt_reused(engine, expected):
    """`write_through="selective"`: a first turn writes nothing (nothing of it was reused); the
    next turn, whose prompt reused the first turn's two chunks from the device, writes those
    two, and not the chunk its own new tokens filled (seen once so far)."""
    base = aligned_turns()
    r = random.Random(2)
    turns = Turns(base.first, base.flood, [r.randrange(1000, 20000) for _ in range(60)])
    tiers = TiersConfig(host_bytes=64 * MIB, chunk_tokens=CHUNK_TOKENS, write_through="selective")
    connector = attach_connector(engine, tiers, "offload")
    first = first_turn(engine, turns)
    assert first == expected[0]
    assert connector.flush(timeout=30)
    assert host_chunks(connector) == 0
    second, _ = run_second(engine, turns, first)
    assert connector.flush(timeout=30)
    chunks = session_chunks(connector)  # 121 + 8 + 60 prompt tokens, 8 generated: 3 chunks
    assert len(chunks) == 3 and all(len(c.keys) == 4 for c in chunks)
    assert [connector.locate(c.id) for c in chunks] == ["host", "host", None]
    assert connector.stats()["counters"]["written_through_chunks"] == 2
    assert_no_leak(engine)
    attach_connector(engine, None)
    assert second == reference(engine, turns, first)


def test_write_through_takes_true_false_or_selective():
    with pytest.raises(KvtierError, match="true, false or 'selective'"):
        TiersConfig(write_through="some")
