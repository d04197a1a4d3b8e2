"""`kvtier bench` replays agents' tool loops: the engine (in process, or behind `kvtier serve`)
learns which turns ended in a call of which tool, and gets the client's session hints."""

from __future__ import annotations

import pytest

from kvtier.bench.http_replay import connect, replay_server
from kvtier.bench.replay import BenchClock, replay, warm_up
from kvtier.session_hints import NO_HINTS
from kvtier.workload.generator import generate
from kvtier.workload.model import Request, flatten
from kvtier.workload.presets import preset_config
from tests.server.conftest import start_server, stop_server

SHORT = {"cv": 0.3, "min_tokens": 16, "max_tokens": 32}


def _tool(median_s: float) -> dict:
    return {
        "share": 1.0,
        "duration_median_s": median_s,
        "duration_sigma": 0.0,
        "result_tokens": {"mean": 24, **SHORT},
    }


def _agents() -> list[Request]:
    """Two short agent sessions with hints (seed 1: calls of both tools, answers between)."""
    tools = {"read_file": _tool(0.2), "run_tests": _tool(0.3)}
    config = preset_config(
        "agentic-hints",
        sessions=2,
        session_rate=5.0,
        max_turns=4,
        mean_turns=2.0,
        followup_share=1.0,
        followup_median_s=0.3,
        system_prompt_tokens=24,
        user_tokens={"mean": 24, **SHORT},
        answer_tokens={"mean": 8, "cv": 0.1, "min_tokens": 6, "max_tokens": 8},
        classes={"agent": {"share": 1.0, "set": {"tools": tools, "tool_call_share": 0.7}}},
    )
    requests = flatten(generate(config, seed=1))
    ends = {r.end for r in requests}
    assert ends == {"tool_call", "answer"} and any(not r.hints.empty for r in requests)
    return requests


def _ends(requests: list[Request]) -> dict[str, tuple[str | None, str | None]]:
    """What the engine should record per turn: a call's tool, else the engine's own end."""
    return {r.request_id: (r.end, r.tool) for r in requests if r.end == "tool_call"}


def test_in_process_replay_marks_tool_calls_and_passes_hints():
    from kvtier.engine import Engine, EngineConfig

    requests = _agents()
    clock = BenchClock()
    config = EngineConfig(dtype="bfloat16", kv_cache_bytes=32 << 20, max_num_seqs=4)
    engine = Engine(config, clock=clock)
    try:
        warm_up(engine)
        clock.restart()
        result = replay(engine, requests, clock, "retain", max_output_tokens=4)
        assert not [r.error for r in result.run.requests if r.failed]
        tracked = {
            t.request_id: t
            for session in {r.session_id for r in requests}
            for t in engine.sessions.turns(session)
        }
        assert {k: (t.end, t.tool) for k, t in tracked.items() if t.end == "tool_call"} == _ends(
            requests
        )
        assert all(tracked[r.request_id].hints == r.hints for r in requests)
        assert any(r.hints != NO_HINTS for r in requests)
        # the turn after a call is sent the tool's run time after the call's reply
        by_id = {r.request_id: r for r in result.run.requests}
        for r in requests:
            if r.turn_index and r.think_s is not None:
                before = by_id[f"{r.session_id}/{r.turn_index - 1}"]
                assert by_id[r.request_id].arrival_s == pytest.approx(before.finish_s + r.think_s)
    finally:
        engine.close()


@pytest.mark.slow
def test_server_replay_sends_tool_messages_the_server_reads_as_calls():
    from kvtier.engine import Engine, EngineConfig
    from kvtier.server.app import create_app
    from kvtier.settings.server import ServerConfig

    requests = _agents()
    engine = Engine(EngineConfig(dtype="bfloat16", kv_cache_bytes=64 << 20, max_num_seqs=4))
    server, thread = start_server(create_app(engine, ServerConfig(model_name="smollm2")))
    try:
        result = replay_server(connect(server.base_url), requests, "tools", max_output_tokens=8)
        assert not [r.error for r in result.run.requests if r.failed]
        tracked = {
            t.request_id: t
            for session in {r.session_id for r in requests}
            for t in engine.sessions.turns(f"anonymous/{session}")
        }
    finally:
        stop_server(server, thread)
        engine.close()
    # the server's request ids are its own: match its records to the turns by order
    turns = sorted(tracked.values(), key=lambda t: (t.session_id, t.turn_index))
    ordered = sorted(requests, key=lambda r: (r.session_id, r.turn_index))
    assert [(t.end == "tool_call", t.tool) for t in turns] == [
        (r.end == "tool_call", r.tool) for r in ordered
    ]
    assert [t.hints for t in turns] == [r.hints for r in ordered]
    # a tool loop's later turn starts with the previous prompt and reply: cached on the device
    later = [r for r in result.run.requests if r.turn_index > 0]
    assert later and all(r.restored_tokens.get("device", 0) > 0 for r in later)
