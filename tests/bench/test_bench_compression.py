"""`kvtier bench --config` with a `[compression]` table: the engine runs the configured
pipeline (or auto's pick for the replayed workload) and results.json records it."""

from __future__ import annotations

import json

import pytest

from kvtier import cli


@pytest.fixture(autouse=True)
def bench_command(monkeypatch):
    commands = {**cli.COMMANDS, "bench": ("kvtier.bench.command", "benchmark policies")}
    monkeypatch.setattr(cli, "COMMANDS", commands)


def _trace(path):
    """Two sessions of two turns, lengths only (bailian format: 16-token hash ids)."""
    rows = [
        {"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.0, "input_length": 40,
         "output_length": 3, "hash_ids": [1, 2, 3]},
        {"chat_id": 2, "parent_chat_id": 1, "timestamp": 900.0, "input_length": 60,
         "output_length": 3, "hash_ids": [1, 2, 3, 4]},
    ]  # fmt: skip
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _bench(tmp_path, table: str) -> dict:
    config = tmp_path / "kvtier.toml"
    config.write_text('[policy]\nname = "retain"\n\n' + table)
    out = tmp_path / "bench"
    argv = ["bench", "--workload", str(_trace(tmp_path / "trace.jsonl")), "--policies", "retain"]
    argv += ["--config", str(config), "--kv-cache-bytes", "16MiB", "--host-bytes", "0"]
    assert cli.main([*argv, "--no-progress", "--no-plots", "--out", str(out)]) == 0
    return json.loads((out / "results.json").read_text())


@pytest.mark.slow
def test_configured_pipeline_reaches_the_engine(tmp_path):
    table = '[compression]\npresses = [{ name = "streaming_llm", keep_tokens = 32 }]\n'
    document = _bench(tmp_path, table)
    note = document["config"]["compression"]
    assert note["pipeline"]["presses"][0]["name"] == "streaming_llm"
    assert note["pipeline"]["presses"][0]["keep_tokens"] == 32
    assert document["runs"][0]["summary"]["completed"] == 2


@pytest.mark.slow
def test_auto_is_resolved_for_the_replayed_workload(tmp_path, capsys):
    document = _bench(tmp_path, '[compression]\npreset = "auto"\n')
    auto = document["config"]["compression"]["auto"]
    # 100 tokens of KV at most in a 16 MiB pool: it fits, so no compression.
    assert auto["preset"] == "full" and "fits with room" in auto["reason"]
    assert document["config"]["compression"]["pipeline"] is None
    assert "compression auto -> full (full)" in capsys.readouterr().out
