"""The cost policy choosing a stored form on the real engine: with a budget that allows INT4 and
a slow disk, its moves store the session as INT4, which comes back decoded; without a budget,
in full precision."""

from __future__ import annotations

import json

import pytest

from kvtier.cache import TiersConfig
from kvtier.cache.setup import attach_connector
from kvtier.policy.actions import Move
from kvtier.policy.config import load_config

from .scenario import GREEDY, assert_no_leak, drain, make_turns, run_second

MIB = 1 << 20
# a CPU-like prefill (about 1,000 tokens/s) and a 100 MB/s disk: a 64-token chunk restores in
# ~15 ms at full precision and ~6 ms as INT4 (load of 0.31x the bytes + this CPU's decode)
SLOW_DISK = [
    "profile.prefill_fixed_s=0.01",
    "profile.prefill_token_s=1e-3",
    "profile.prefill_pair_s=1e-8",
    "profile.links.disk={bandwidth = 1e8, latency_s = 1e-4}",
]


def demote_idle_session(engine, tmp_path, budget: float):
    figures = tmp_path / "forms.json"
    figures.write_text(json.dumps({"models": ["any"], "forms": {"int4": {"loss": 1.0}}}))
    settings = [*SLOW_DISK, f"max_accuracy_loss={budget}", f'accuracy_file="{figures}"']
    config = load_config(None, settings=settings, policy="cost")
    tiers = TiersConfig(
        host_bytes=0, disk_bytes=64 * MIB, disk_dir=tmp_path / "disk", chunk_tokens=64
    )
    connector = attach_connector(engine, tiers, "cost", config)
    turns = make_turns(0)
    rid = engine.add_request(turns.first, GREEDY, session_id="s1")
    first = drain(engine)[rid]
    # the device is wanted whole: the idle session must leave it, for disk (not dropped: a
    # recompute costs far more than a load here)
    need = engine.block_pool.num_blocks * connector.bytes_per_block
    actions = connector.runner.run("pressure", need)
    assert connector.flush(timeout=30)
    moves = [a for a in actions if isinstance(a, Move)]
    assert moves and {m.tier for m in moves} == {"disk"}
    return connector, turns, first, moves


@pytest.mark.slow
def test_with_a_budget_the_cost_policy_stores_an_idle_session_as_int4(engine, tmp_path):
    connector, turns, first, moves = demote_idle_session(engine, tmp_path, 1.0)
    assert {m.form for m in moves} == {"int4"}
    assert {p.form for p in connector.store._index.values()} == {"int4"}
    assert engine.stats().tiers["recodes"]["full->int4"]["ops"] == len(moves)
    _second, out = run_second(engine, turns, first)
    restored = out.metrics.prompt_token_sources.get("disk", 0) // 16
    assert restored > 0 and connector.counters["restored_blocks_int4"] == restored
    assert_no_leak(engine)


@pytest.mark.slow
def test_without_a_budget_the_session_stays_in_full_precision(engine, tmp_path):
    connector, turns, first, moves = demote_idle_session(engine, tmp_path, 0.0)
    assert {m.form for m in moves} == {"full"}
    assert {p.form for p in connector.store._index.values()} == {"full"}
    _second, out = run_second(engine, turns, first)
    assert out.metrics.prompt_token_sources.get("disk", 0) > 0
    assert connector.counters["restored_blocks_int4"] == 0
