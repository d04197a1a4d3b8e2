"""The retention policy acting on the engine's real blocks through the policy runner."""

from __future__ import annotations

import pytest

from kvtier.cache import TiersConfig
from kvtier.cache.setup import attach_connector
from kvtier.engine import SamplingParams
from kvtier.policy.actions import Drop, Move
from kvtier.policy.config import OffloadSection, PolicyConfig, PredictorSection

from .scenario import GREEDY, assert_no_leak, drain, make_turns, reference, run_second

pytestmark = pytest.mark.slow

MIB = 1 << 20


def first_turn(engine, turns) -> list[int]:
    rid = engine.add_request(turns.first, GREEDY, session_id="s1")
    return drain(engine)[rid]


def session_tiers(connector) -> list[str | None]:
    view = connector.runner.view()
    (session,) = [s for s in view.sessions if s.session_id == "s1"]
    return [chunk.tier for chunk in session.chunks]


def test_recompute_policy_drops_idle_session(engine, expected, clock):
    turns = make_turns(0)
    connector = attach_connector(
        engine, TiersConfig(host_bytes=64 * MIB, chunk_tokens=64), "recompute"
    )
    first = first_turn(engine, turns)
    assert first == expected[0]
    assert set(session_tiers(connector)) == {"device"}
    clock.advance(connector.runner.interval_s + 1)
    engine.step()  # the timer fires after a step, even an empty one
    assert connector.runner.runs["timer"] >= 1
    assert connector.runner.decisions["drop"] >= 1
    assert set(session_tiers(connector)) == {None}
    second, out = run_second(engine, turns, first)
    assert second == expected[1]
    assert out.metrics.prompt_token_sources["device"] == 0
    assert engine.stats().tiers["decisions"]["drop"] >= 1
    assert_no_leak(engine)


def test_offload_policy_moves_idle_session_to_host(engine, expected, clock):
    turns = make_turns(0)
    config = PolicyConfig(offload=OffloadSection(watermark=0.2))
    connector = attach_connector(
        engine, TiersConfig(host_bytes=64 * MIB, chunk_tokens=64), "offload", config
    )
    first = first_turn(engine, turns)
    clock.advance(connector.runner.interval_s + 1)
    engine.step()
    assert connector.runner.decisions["move"] >= 1
    assert connector.flush(timeout=30)  # the move's write ran on the mover's worker
    tiers = session_tiers(connector)
    assert "host" in tiers, tiers
    assert connector.store.snapshot()["tiers"]["host"]["chunks"] >= 1
    assert connector.counters["policy_moved_bytes_device->host"] > 0
    second, out = run_second(engine, turns, first)
    assert out.metrics.prompt_token_sources["host"] > 0
    assert second == expected[1]
    assert_no_leak(engine)


def test_sessions_the_tracker_forgets_lose_their_stored_kv(engine, clock):
    """A session idle past the tracker's expiry leaves the policy's view and its KV leaves
    the tiers, so neither grows for as long as the engine runs."""
    turns = make_turns(0)
    config = PolicyConfig(offload=OffloadSection(watermark=0.2))
    connector = attach_connector(
        engine, TiersConfig(host_bytes=64 * MIB, chunk_tokens=64), "offload", config
    )
    first_turn(engine, turns)
    clock.advance(connector.runner.interval_s + 1)
    engine.step()  # offload moves the idle session to host
    assert connector.flush(timeout=30)
    assert connector.store.snapshot()["tiers"]["host"]["chunks"] >= 1
    tracker = engine.sessions
    saved = tracker.forget_after_s
    try:
        tracker.forget_after_s = 60.0
        clock.advance(3600)
        engine.add_request([1, 2, 3], GREEDY, session_id="other")  # a turn sweeps the tracker
        drain(engine)
        assert "s1" not in tracker.sessions
        connector.runner.run("timer")
        assert "s1" not in connector.runner.sessions
        assert connector.runner.decisions["forgotten"] == 1
        assert connector.flush(timeout=30)
        assert connector.store.snapshot()["tiers"]["host"]["chunks"] == 0
    finally:
        tracker.forget_after_s = saved
    assert_no_leak(engine)


def test_dropping_one_session_keeps_the_prefix_it_shares_with_another(engine, clock):
    """Two sessions open on the same 64-token prompt (a system prompt, through the prefix
    cache). A policy that drops one of them must leave the shared blocks, or the other
    session's whole history becomes unreachable on the device and is recomputed."""
    from kvtier.policy.oracle import OraclePolicy

    shared = list(range(1000, 1064))
    first = {"a": shared + list(range(2000, 2040)), "b": shared + list(range(3000, 3040))}
    now = clock.now()
    oracle = OraclePolicy({"a": [now], "b": [now, now + 3600]})  # only b comes back
    connector = attach_connector(engine, TiersConfig(host_bytes=64 * MIB, chunk_tokens=64), oracle)
    outputs = {}
    for session, prompt in first.items():
        rid = engine.add_request(prompt, GREEDY, session_id=session)
        outputs[session] = drain(engine)[rid]
    clock.advance(1)
    connector.runner.run("timer")
    assert connector.runner.decisions["drop"] >= 1  # a's KV went
    assert connector.counters["policy_dropped_blocks"] >= 1
    second = first["b"] + outputs["b"] + list(range(4000, 4010))
    rid = engine.add_request(second, GREEDY, session_id="b")
    out = None
    while engine.has_unfinished_requests():
        for step_out in engine.step():
            if step_out.finished and step_out.request_id == rid:
                out = step_out
    history_blocks = (len(first["b"]) + len(outputs["b"])) // 16
    assert out.metrics.prompt_token_sources["device"] >= 16 * (history_blocks - 1)
    assert_no_leak(engine)


def test_actions_move_chunks_down_only_and_drop_frees_every_tier(engine, tmp_path):
    """The runner reads actions through the shared executor: down host -> disk happens, back
    up (or to the device) is skipped and counted, and a drop empties every tier."""
    turns = make_turns(0)
    tiers = TiersConfig(
        host_bytes=64 * MIB, disk_bytes=64 * MIB, disk_dir=tmp_path / "d", chunk_tokens=64
    )
    connector = attach_connector(engine, tiers, "retain")
    first_turn(engine, turns)
    runner = connector.runner
    count = len(session_tiers(connector))
    runner.execute(Move("s1", None, "host"))
    assert connector.flush(timeout=30)
    assert set(session_tiers(connector)) == {"host"}
    runner.execute(Move("s1", None, "disk"))
    assert connector.flush(timeout=30)
    assert set(session_tiers(connector)) == {"disk"}
    assert connector.counters["policy_moved_bytes_host->disk"] > 0
    runner.execute(Move("s1", None, "host"))
    runner.execute(Move("s1", 0, "device"))
    assert runner.skipped["move_up"] == count
    assert runner.skipped["move_target"] == 1
    assert connector.flush(timeout=30)
    assert set(session_tiers(connector)) == {"disk"}
    runner.execute(Drop("s1"))
    assert connector.flush(timeout=30)
    assert set(session_tiers(connector)) == {None}
    assert connector.store.snapshot()["tiers"]["disk"]["chunks"] == 0
    assert runner.decisions["move"] == 4 and runner.decisions["drop"] == 1
    assert_no_leak(engine)


def test_a_moved_session_restores_the_prompt_its_next_turn_resends_without_the_answer(engine):
    """A chat client resends the answer as text, which often tokenizes differently: the next
    prompt shares the previous prompt's blocks, not the answer's. The chunk that holds the end
    of the prompt and the start of the answer still serves the shared blocks from the tier
    (as the device's prefix cache would), instead of their being recomputed."""
    turns = make_turns(0)  # a 150-token prompt: 9 full blocks, the 10th block half answer
    connector = attach_connector(
        engine, TiersConfig(host_bytes=64 * MIB, chunk_tokens=64), "retain"
    )
    answer = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine.add_request(turns.first, answer, session_id="s1")
    drain(engine)  # 173 tokens computed: 10 full blocks, chunks of 4, 4 and 2 blocks
    connector.runner.execute(Move("s1", None, "host"))
    assert connector.flush(timeout=30)
    assert set(session_tiers(connector)) == {"host"}
    output, out = run_second(engine, turns, [])  # the answer is not resent as generated
    sources = out.metrics.prompt_token_sources
    shared = len(turns.first) // 16 * 16  # the prompt's full blocks: 144 tokens
    assert sources["host"] == shared, sources
    assert sources["recomputed"] == len(turns.second([])) - shared
    assert_no_leak(engine)
    attach_connector(engine, None)
    assert output == reference(engine, turns, [])


def test_the_view_counts_what_each_turn_added_to_the_context(engine):
    """`TurnView.prompt_tokens` is what a turn added to the context (the simulator's
    meaning, which the cost policy's demand forecast sums): a turn that resends the history
    adds its new message and the previous reply, not its whole prompt again."""
    turns = make_turns(0)
    connector = attach_connector(engine, TiersConfig(host_bytes=64 * MIB), "cost")
    rid = engine.add_request(turns.first, GREEDY, session_id="context")  # the engine's first
    first = drain(engine)[rid]
    run_second(engine, turns, first, session="context")
    (session,) = [s for s in connector.runner.view().sessions if s.session_id == "context"]
    second = len(turns.second(first))
    assert [t.prompt_tokens for t in session.turns] == [len(turns.first), second - len(turns.first)]
    assert sum(t.prompt_tokens for t in session.turns) == second
    assert_no_leak(engine)


def test_cost_policy_keeps_a_session_past_the_cut_off_until_its_space_is_needed(
    engine, expected, clock
):
    """The cost policy's predictor counts a session idle past its cut-off age as never
    returning; its KV stays on a device with room instead of being dropped, so when a long
    prompt needs the blocks the engine's eviction spills them to host like any idle block,
    and the next turn loads it."""
    turns = make_turns(0)
    config = PolicyConfig(predictor=PredictorSection(max_age_s=60.0))
    connector = attach_connector(
        engine, TiersConfig(host_bytes=64 * MIB, chunk_tokens=64), "cost", config
    )
    first = first_turn(engine, turns)
    clock.advance(max(61.0, connector.runner.interval_s + 1))
    engine.step()  # the timer decides on the session, idle past the cut-off
    assert connector.runner.runs["timer"] >= 1
    assert set(session_tiers(connector)) == {"device"}
    engine.add_request(turns.flood, GREEDY, session_id="s1-flood")
    drain(engine)
    assert connector.flush(timeout=30)
    tiers = session_tiers(connector)
    assert "host" in tiers, tiers
    second, out = run_second(engine, turns, first)
    assert second == expected[1]
    assert out.metrics.prompt_token_sources["host"] > 0
    assert_no_leak(engine)


def test_under_pressure_the_runner_drops_what_the_cost_policy_evicts_past_the_cut_off(
    engine, expected, clock
):
    """Asked for the whole device, the cost policy evicts the session idle past its cut-off
    first and drops it (the request waiting for the space would wait for a copy); the runner
    frees its blocks like any other drop, and the next turn recomputes it."""
    turns = make_turns(0)
    config = PolicyConfig(predictor=PredictorSection(max_age_s=60.0))
    connector = attach_connector(
        engine, TiersConfig(host_bytes=64 * MIB, chunk_tokens=64), "cost", config
    )
    first = first_turn(engine, turns)
    clock.advance(61.0)
    need = engine.block_pool.num_blocks * connector.bytes_per_block
    actions = connector.runner.run("pressure", need)
    assert not [a for a in actions if isinstance(a, Move)]
    assert {a.session_id for a in actions if isinstance(a, Drop)} == {"s1"}
    assert connector.flush(timeout=30)
    assert set(session_tiers(connector)) == {None}
    second, out = run_second(engine, turns, first)
    assert second == expected[1]
    assert out.metrics.prompt_token_sources["device"] == 0
    assert_no_leak(engine)


@pytest.mark.parametrize("flood", [False, True])
def test_with_keep_moved_a_moved_session_resumes_from_its_kept_blocks_until_they_are_used(
    engine, expected, flood
):
    """`keep_moved`: a session moved to host keeps its device blocks. The policy sees them as
    free and the chunks as on host; the next turn finds them on the device with nothing to
    load. A long prompt in between takes free blocks, then kept ones, with no spill (host
    holds the chunks), the session's tail first as they went idle: the next turn finds its
    head on the device and loads the rest from host. Both give the reference output."""
    turns = make_turns(0)
    tiers = TiersConfig(host_bytes=64 * MIB, chunk_tokens=64, keep_moved=True)
    connector = attach_connector(engine, tiers, "retain")
    first = first_turn(engine, turns)
    pool = engine.block_pool
    hits_before = pool.num_kept_hits  # the engine is shared between tests
    connector.runner.execute(Move("s1", None, "host"))
    assert connector.flush(timeout=30)
    assert set(session_tiers(connector)) == {"host"}
    kept = pool.num_kept
    assert kept == len(turns.first) // 16  # every full block of the first turn
    (device,) = [t for t in connector.runner.view().tiers if t.name == "device"]
    assert device.used_bytes == 0
    if flood:
        engine.add_request(turns.flood, GREEDY, session_id="s1-flood")
        drain(engine)
        assert connector.flush(timeout=30)
        assert 0 < pool.num_kept < kept  # the flood took some kept blocks
        kept = pool.num_kept
        assert connector.counters["spilled_chunks"] == 0  # host already held them
    second, out = run_second(engine, turns, first)
    assert second == expected[1]
    sources = out.metrics.prompt_token_sources
    assert pool.num_kept_hits - hits_before == kept  # each block still kept was hit
    assert engine.stats().tiers["counters"]["kept_blocks_hit"] == pool.num_kept_hits
    assert sources["device"] == kept * 16
    assert (sources["host"] > 0) == flood
    assert_no_leak(engine)
