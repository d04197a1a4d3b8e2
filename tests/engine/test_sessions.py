"""Sessions: turns are new / continuing / resumed by the gap since the previous turn ended,
and a follow-up turn finds its history's KV on device."""

from __future__ import annotations

from kvtier.clock import VirtualClock
from kvtier.engine import SamplingParams
from kvtier.engine.sessions import SessionTracker, TurnKind
from kvtier.session_hints import SessionHints


def test_turn_kinds_follow_the_gap_since_the_previous_turn_ended():
    clock = VirtualClock(1000.0)
    tracker = SessionTracker(clock, resume_after_s=30)
    first = tracker.start_turn("s", "r1", 10)
    clock.advance(100)  # a long first turn: the gap counts from its end, not its start
    tracker.end_turn("r1")
    clock.advance(29)
    second = tracker.start_turn("s", "r2", 20)
    tracker.end_turn("r2")
    clock.advance(31)
    third = tracker.start_turn("s", "r3", 30)
    other = tracker.start_turn("other", "r4", 5)

    assert [first.kind, second.kind, third.kind] == [
        TurnKind.NEW,
        TurnKind.CONTINUING,
        TurnKind.RESUMED,
    ]
    assert second.gap_s == 29 and third.gap_s == 31
    assert other.kind is TurnKind.NEW
    assert [t.turn_index for t in tracker.turns("s")] == [0, 1, 2]


def test_memory_is_bounded_idle_sessions_are_forgotten():
    clock = VirtualClock(1000.0)
    tracker = SessionTracker(clock, resume_after_s=30, forget_after_s=1000, max_turns=3)
    for i in range(5):
        tracker.start_turn("long", f"l{i}", 10)
        tracker.end_turn(f"l{i}")
        clock.advance(10)
    assert [t.turn_index for t in tracker.turns("long")] == [2, 3, 4]  # the last three kept
    tracker.start_turn("running", "run", 10)  # never ends: must not be forgotten
    tracker.start_turn("idle", "i0", 10)
    tracker.end_turn("i0")
    clock.advance(990)
    tracker.start_turn("fresh", "f0", 10)  # "long" ended 1,000 s ago: still remembered
    assert "long" in tracker.sessions
    clock.advance(120)  # past the next sweep (every 100 s here)
    again = tracker.start_turn("long", "l5", 10)  # 1,120 s idle: forgotten, counts as new
    assert again.kind is TurnKind.NEW and again.turn_index == 0
    assert "idle" not in tracker.sessions  # idle 1,110 s
    assert "running" in tracker.sessions and "fresh" in tracker.sessions
    assert tracker.turns("idle") == []


def test_turn_arriving_while_the_previous_runs_is_continuing():
    clock = VirtualClock(1000.0)
    tracker = SessionTracker(clock, resume_after_s=30)
    tracker.start_turn("s", "r1", 10)
    clock.advance(500)
    assert tracker.start_turn("s", "r2", 10).kind is TurnKind.CONTINUING


def test_second_turn_finds_its_prefix_on_device(chunked_engine, fake_clock):
    engine = chunked_engine
    greedy = SamplingParams(temperature=0, max_tokens=12)
    history = [{"role": "user", "content": "Name a large city in Japan."}]
    turn1 = engine.add_request(history, greedy, session_id="chat-1")
    text = _run_to_end(engine, turn1)

    fake_clock.advance(5)
    history += [
        {"role": "assistant", "content": text},
        {"role": "user", "content": "And one in Italy?"},
    ]
    turn2 = engine.add_request(history, greedy, session_id="chat-1")
    _run_to_end(engine, turn2)

    fake_clock.advance(3600)
    turn3 = engine.add_request(history, greedy, session_id="chat-1")
    _run_to_end(engine, turn3)

    first, second, third = engine.sessions.turns("chat-1")
    assert (first.kind, second.kind, third.kind) == (
        TurnKind.NEW,
        TurnKind.CONTINUING,
        TurnKind.RESUMED,
    )
    assert first.num_cached_tokens == 0
    # Turn 1's prompt blocks (and the full blocks of its answer) are reused by turn 2.
    assert second.num_cached_tokens >= (first.num_prompt_tokens // 16) * 16 > 0
    assert 0 < second.prefix_on_device < 1
    assert second.gap_s == 5 and third.gap_s == 3600
    assert third.ended_at is not None


def _run_to_end(engine, request_id: str) -> str:
    text = []
    while engine.has_unfinished_requests():
        text += [o.delta_text for o in engine.step() if o.request_id == request_id]
    return "".join(text)


def test_beyond_max_sessions_the_least_recently_active_is_forgotten():
    clock = VirtualClock(1000.0)
    tracker = SessionTracker(clock, max_sessions=3)
    for name in ("a", "b", "c"):
        tracker.start_turn(name, f"{name}0", 10)
        tracker.end_turn(f"{name}0")
        clock.advance(1)
    tracker.start_turn("a", "a1", 10)  # a is now the most recently active
    tracker.end_turn("a1")
    tracker.start_turn("d", "d0", 10)
    assert list(tracker.sessions) == ["a", "c", "d"]  # b went; first-seen order kept
    assert tracker.num_evicted == 1
    again = tracker.start_turn("b", "b1", 10)  # forgotten: new again, and c goes
    assert again.kind is TurnKind.NEW and again.turn_index == 0
    assert list(tracker.sessions) == ["a", "d", "b"] and tracker.num_evicted == 2


def test_a_turn_records_how_it_ended_and_its_hints():
    clock = VirtualClock(0.0)
    tracker = SessionTracker(clock)
    hints = SessionHints(expect_return_s=3.0)
    tracker.start_turn("s", "r1", 10, hints)
    tracker.end_turn("r1", "length")
    tracker.start_turn("s", "r2", 20)
    tracker.end_turn("r2", "answer")
    # the server's parser found a tool call in r2's reply, after the engine ended it
    assert tracker.mark_end("s", "r2", "tool_call", "search")
    assert not tracker.mark_end("s", "r9", "tool_call", "search")  # no such turn
    assert not tracker.mark_end("gone", "r2", "tool_call", "search")
    first, second = tracker.turns("s")
    assert (first.end, first.tool, first.hints) == ("length", None, hints)
    assert (second.end, second.tool, second.hints.empty) == ("tool_call", "search", True)
    # a mark made while the turn still ran is not overwritten when it ends
    tracker.start_turn("s", "r3", 30)
    tracker.mark_end("s", "r3", "tool_call", "edit")
    tracker.end_turn("r3", "answer")
    assert tracker.turns("s")[-1].end == "tool_call"


def test_a_pin_not_in_force_is_withdrawn_from_the_latest_turn():
    tracker = SessionTracker(VirtualClock(0.0))
    tracker.start_turn("s", "r1", 10, SessionHints(pin=True, priority=2))
    tracker.end_turn("r1", "answer")
    assert tracker.turns("s")[-1].hints.pins
    assert tracker.withdraw_pin("s")  # refused over a quota, or unpinned by an admin
    assert tracker.turns("s")[-1].hints == SessionHints(priority=2)  # the other hints stay
    assert not tracker.withdraw_pin("s") and not tracker.withdraw_pin("gone")
