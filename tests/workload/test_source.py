"""`--workload SPEC` as every command reads it: presets with KEY=VALUE settings, trace files."""

from __future__ import annotations

import json

import pytest

from kvtier.errors import KvtierError
from kvtier.workload.source import load_workload, preset_with_settings


def test_settings_reach_into_tables_and_parse_json():
    config = preset_with_settings("demo", ["sessions=3", "answer_tokens.mean=10", "apps=1"])
    assert config.sessions == 3
    assert config.answer_tokens.mean == 10
    assert config.apps == 1


@pytest.mark.parametrize(
    "setting, message",
    [("sessions", "KEY=VALUE"), ("=3", "KEY=VALUE"), ("sessions.x=1", "is not a table")],
)
def test_bad_settings_are_named(setting, message):
    with pytest.raises(KvtierError, match=message):
        preset_with_settings("demo", [setting])


def test_demo_preset_is_what_bench_quick_replays():
    workload = load_workload("demo", seed=0)
    assert len(workload.sessions) == 2
    assert all(len(s.turns) <= 3 for s in workload.sessions)
    # histories long enough that recomputing one takes seconds on a CPU
    assert all(s.turns[0].user_tokens >= 4400 for s in workload.sessions)
    kept = load_workload("demo", seed=0, sessions=1).sessions
    assert len(kept) == 1 and kept[0] in workload.sessions


def test_trace_files_and_errors(tmp_path):
    with pytest.raises(KvtierError, match="neither a preset"):
        load_workload(str(tmp_path / "missing.jsonl"))
    with pytest.raises(KvtierError, match="at least 1"):
        load_workload("demo", sessions=0)
    trace = tmp_path / "t.jsonl"
    row = {"timestamp": 0, "input_length": 40, "output_length": 3, "hash_ids": [1, 2, 3]}
    trace.write_text(json.dumps(row) + "\n")
    assert len(load_workload(str(trace), trace_format="mooncake").sessions) == 1
    with pytest.raises(KvtierError, match="not trace files"):
        load_workload(str(trace), settings=["sessions=2"])
