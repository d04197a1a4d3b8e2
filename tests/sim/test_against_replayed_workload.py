"""`kvtier simulate --against RUN` replays the sessions that run kept (`bench --sessions`) at
the scale it replayed them (`bench --scale-to-context`), not the whole preset."""

from __future__ import annotations

from kvtier.sim.command import _as_replayed
from kvtier.workload.model import flatten
from kvtier.workload.source import load_workload


def test_the_runs_sessions_and_scale_are_replayed():
    bench = load_workload("agentic", sessions=3, scale_to=4000)
    like = {
        "workload": {
            "name": "agentic",
            "sessions": len(bench.sessions),
            "length_scale": bench.length_scale,
        }
    }
    replayed = _as_replayed(load_workload("agentic"), like, resume_after_s=30.0)
    assert [s.session_id for s in replayed.sessions] == [s.session_id for s in bench.sessions]
    ours = {r.request_id: (r.prompt_tokens, r.output_tokens) for r in flatten(replayed)}
    theirs = {r.request_id: (r.prompt_tokens, r.output_tokens) for r in flatten(bench)}
    assert ours == theirs
    assert max(p + o for p, o in ours.values()) <= 4000


def test_a_run_of_the_whole_workload_changes_nothing():
    whole = load_workload("quick")
    like = {"workload": {"sessions": len(whole.sessions), "length_scale": 1.0}}
    assert _as_replayed(whole, like, 30.0) is whole
    assert _as_replayed(whole, {"workload": "quick"}, 30.0) is whole  # a simulate run's
