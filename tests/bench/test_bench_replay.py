"""The replay driver against the real engine: every request completes, turn kinds come from
the engine's session tracker, and idle time costs no wall time."""

from __future__ import annotations

import time

import pytest

from kvtier.bench.replay import BenchClock, prompt_token_ids, replay, warm_up
from kvtier.workload.arrivals import next_arrivals
from kvtier.workload.model import Session, Turn, Workload, flatten

GAP_S = 600.0  # between turns: far beyond resume_after_s, and far beyond the replay's wall time


def _workload() -> Workload:
    def session(name: str, start: float, second_think: float | None) -> Session:
        second_at = start + GAP_S
        return Session(
            name,
            [
                Turn(start, 12, 4, f"Hello, this is {name}. Tell me a story.", "Once upon a time."),
                Turn(second_at, 6, 4, "Go on, please.", "And then.", think_s=second_think),
            ],
        )

    # a: the second turn at its trace time; b: closed loop (answer end + think time)
    return Workload([session("a", 0.0, None), session("b", 3.0, GAP_S)], source="test")


@pytest.fixture(scope="module")
def replayed():
    from kvtier.engine import Engine, EngineConfig

    requests = flatten(_workload())
    clock = BenchClock()
    engine = Engine(EngineConfig(kv_cache_bytes=32 << 20, max_num_seqs=4), clock=clock)
    warm_up(engine)
    clock.restart()
    arrivals = next_arrivals(requests)
    started = time.perf_counter()
    result = replay(engine, requests, clock, "retain", arrivals=arrivals, max_output_tokens=4)
    wall = time.perf_counter() - started
    yield requests, result, wall, arrivals, engine
    engine.close()


def test_all_requests_complete(replayed):
    requests, result, _, _, _ = replayed
    records = result.run.requests
    assert len(records) == len(requests) == 4
    assert all(not r.failed for r in records), [r.error for r in records]
    assert all(r.output_tokens == 4 for r in records)
    for r in records:
        assert r.arrival_s <= r.scheduled_s <= r.first_token_s <= r.finish_s
        assert len(r.itl_s) == 3 and r.max_itl_s == max(r.itl_s)


def test_turn_kinds_from_the_engine(replayed):
    _, result, _, _, engine = replayed
    kinds = {r.request_id: r.turn_kind for r in result.run.requests}
    assert kinds == {"a/0": "new", "a/1": "resumed", "b/0": "new", "b/1": "resumed"}
    tracked = {t.request_id: t.kind.value for t in engine.sessions.turns("a")}
    assert tracked == {"a/0": "new", "a/1": "resumed"}


def test_closed_loop_turn_waits_for_the_answer_plus_think_time(replayed):
    _, result, _, arrivals, _ = replayed
    by_id = {r.request_id: r for r in result.run.requests}
    assert by_id["a/1"].arrival_s == pytest.approx(GAP_S)  # trace time
    assert by_id["b/1"].arrival_s == pytest.approx(by_id["b/0"].finish_s + GAP_S)
    assert arrivals["b"][1] == pytest.approx(by_id["b/1"].arrival_s)  # what the oracle sees


def test_idle_time_is_skipped(replayed):
    _, result, wall, _, _ = replayed
    span = max(r.finish_s for r in result.run.requests)
    assert span > GAP_S
    assert result.skipped_s > 0.9 * span
    assert wall < span / 5
    assert result.trace_s == pytest.approx(result.wall_s + result.skipped_s, abs=1.0)


def test_history_is_found_on_device(replayed):
    _, result, _, _, _ = replayed
    second = [r for r in result.run.requests if r.turn_index == 1]
    for r in second:
        assert r.restored_tokens.get("device", 0) >= 16  # the first turn's blocks
        assert r.restored_tokens.get("recomputed", 0) == 0  # a roomy pool kept them


def test_length_only_requests_get_shared_synthetic_prefixes(replayed):
    from kvtier.workload.model import Request

    *_, engine = replayed

    def request(rid: str, hash_ids: tuple[int, ...], n: int) -> Request:
        return Request(rid, "s", 0, 0.0, "t", "chat", n, 4, hash_ids, 16, [], None)

    one = prompt_token_ids(engine, request("x/0", (1, 2), 40))
    two = prompt_token_ids(engine, request("y/0", (1, 3), 40))
    assert len(one) == len(two) == 40
    assert one[:16] == two[:16] and one[16:32] != two[16:32]
