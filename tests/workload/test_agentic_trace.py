"""The agentic trace format (LLMServingSim's sessions of sub-requests): read as tool loops,
written from a generated workload and read back the same."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.session_hints import SessionHints
from kvtier.workload.agentic_trace import load_agentic, write_agentic
from kvtier.workload.generator import generate
from kvtier.workload.model import flatten
from kvtier.workload.presets import preset_config
from kvtier.workload.traces import detect_format, load_trace

# LLMServingSim's documented example, then one of its flat requests
EXAMPLE = {
    "session_id": "session_42",
    "arrival_time_ns": 4059740,
    "sub_requests": [
        {"input_toks": 1472, "output_toks": 133, "tool_duration_ns": 127348767},
        {"input_toks": 1582, "output_toks": 125, "tool_duration_ns": 197295027},
        {"input_toks": 1734, "output_toks": 77, "tool_duration_ns": 0},
    ],
}
FLAT = {"input_toks": 100, "output_toks": 50, "arrival_time_ns": 2_000_000_000}


def _write(path: Path, *lines: object) -> Path:
    path.write_text(
        "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    )
    return path


def test_a_session_line_is_a_tool_loop(tmp_path):
    path = _write(tmp_path / "llmservingsim.jsonl", EXAMPLE, FLAT)
    assert detect_format(path) == "agentic"
    workload = load_trace(path)
    loop, flat = workload.sessions
    assert loop.session_id == "session_42" and loop.app_class == "agent"
    assert [t.prompt_tokens for t in loop.turns] == [1472, 1582, 1734]
    # (the second prompt grew less than the first answer: the answer was not resent whole)
    assert [t.user_tokens for t in loop.turns] == [1472, 0, 1734 - 1582 - 125]
    assert [t.think_s for t in loop.turns] == [None, 0.127348767, 0.197295027]
    assert [(t.end, t.tool) for t in loop.turns] == [
        ("tool_call", "tool"),
        ("tool_call", "tool"),
        ("answer", None),
    ]
    first, second = loop.turns[:2]
    assert first.arrival_s == pytest.approx(0.00405974)
    assert second.arrival_s == pytest.approx(first.arrival_s + 133 / 50 + 0.127348767)
    # each prompt is the previous prompt and answer, then the tool's result
    whole_blocks = 1472 // 16
    assert second.hash_ids[:whole_blocks] == first.hash_ids[:whole_blocks]
    assert len(second.hash_ids) == -(-1582 // 16)
    assert [(t.prompt_tokens, t.end, t.arrival_s) for t in flat.turns] == [(100, "answer", 2.0)]


def test_token_ids_decide_prefix_sharing(tmp_path):
    shared = list(range(32))
    lines = [
        {
            "session_id": name,
            "arrival_time_ns": 0,
            "sub_requests": [
                {"input_toks": 40, "output_toks": 4, "input_tok_ids": [*shared, *tail]},
            ],
        }
        for name, tail in (("a", [1] * 8), ("b", [2] * 8))
    ]
    a, b = load_agentic(_write(tmp_path / "ids.jsonl", *lines)).sessions
    assert a.turns[0].hash_ids[:2] == b.turns[0].hash_ids[:2]
    assert a.turns[0].hash_ids[2] != b.turns[0].hash_ids[2]


def test_kvtier_extensions_set_ends_tools_hints_and_the_shared_system_prompt(tmp_path):
    def session(name: str) -> dict:
        return {
            "session_id": name,
            "arrival_time_ns": 0,
            "tenant": "acme",
            "app_class": "coder",
            "system_toks": 64,
            "sub_requests": [
                {
                    "input_toks": 80,
                    "output_toks": 8,
                    "tool_duration_ns": 5 * 10**8,
                    "tool": "run_tests",
                    "kvtier_session": {"expect_return_s": 0.5},
                },
                {"input_toks": 120, "output_toks": 8, "end": "answer", "tool_duration_ns": 9e10},
                {"input_toks": 200, "output_toks": 8, "end": None},
            ],
        }

    a, b = load_agentic(_write(tmp_path / "ext.jsonl", session("a"), session("b"))).sessions
    assert (a.tenant, a.app_class, a.system_tokens) == ("acme", "coder", 64)
    assert [(t.end, t.tool) for t in a.turns] == [
        ("tool_call", "run_tests"),
        ("answer", None),
        (None, None),
    ]
    assert a.turns[0].hints == SessionHints(expect_return_s=0.5)
    assert a.turns[0].user_tokens == 80 - 64
    assert a.turns[2].think_s == 90.0  # after an answer: the user's pause
    # the app class's system prompt is one prefix; the sessions part after it
    assert a.turns[0].hash_ids[:4] == b.turns[0].hash_ids[:4]
    assert a.turns[0].hash_ids[4] != b.turns[0].hash_ids[4]


def test_bad_lines_are_reported_with_their_numbers_and_the_rest_is_read(tmp_path, caplog):
    bad_call = {**EXAMPLE, "session_id": "x", "sub_requests": [{"input_toks": 5}]}
    bad_end = {**EXAMPLE, "session_id": "y", "sub_requests": [{**FLAT, "end": "done"}]}
    bad_hint = {
        **EXAMPLE,
        "session_id": "z",
        "sub_requests": [{**FLAT, "kvtier_session": {"priority": 99}}],
    }
    path = _write(
        tmp_path / "bad.jsonl",
        EXAMPLE,
        "{not json",
        {"sub_requests": [FLAT]},
        bad_call,
        bad_end,
        bad_hint,
        {**EXAMPLE, "sub_requests": []},
        EXAMPLE,
    )
    with caplog.at_level(logging.WARNING, logger="kvtier.workload"):
        workload = load_agentic(path)
    assert [s.session_id for s in workload.sessions] == ["session_42"]
    assert [error.split(":")[0] for error in workload.errors] == [f"line {n}" for n in range(2, 9)]
    assert "arrival_time_ns" in workload.errors[1]
    assert "sub_requests[0]: missing field 'output_toks'" in workload.errors[2]
    assert "'end'" in workload.errors[3] and "priority" in workload.errors[4]
    assert "repeats" in workload.errors[6]
    assert "skipped 7 bad record(s)" in caplog.text


def test_the_agentic_preset_written_and_read_back_is_the_same_workload(tmp_path):
    config = preset_config("agentic-hints", sessions=6, max_turns=6)
    generated = generate(config, seed=1)
    path = tmp_path / "agentic.jsonl"
    assert (
        main(
            [
                "export",
                str(path),
                "--workload",
                "agentic-hints",
                "--seed",
                "1",
                "--workload-set",
                "sessions=6",
                "--workload-set",
                "max_turns=6",
            ]
        )
        == 0
    )
    read = load_trace(path)
    assert not read.errors
    assert any(t.end == "tool_call" for s in read.sessions for t in s.turns)

    def shape(workload):
        return [
            (
                s.session_id,
                s.tenant,
                s.app_class,
                s.system_tokens,
                [(t.user_tokens, t.output_tokens, t.end, t.tool, t.hints) for t in s.turns],
            )
            for s in workload.sessions
        ]

    assert shape(read) == shape(generated)
    for mine, theirs in zip(read.sessions, generated.sessions, strict=True):
        for a, b in zip(mine.turns, theirs.turns, strict=True):
            assert a.arrival_s == pytest.approx(b.arrival_s, abs=1e-6)
            assert a.think_s == pytest.approx(b.think_s, abs=1e-9)
    # the same prompts, sharing the same prefixes
    requests, original = flatten(read), flatten(generated)
    assert [r.prompt_tokens for r in requests] == [r.prompt_tokens for r in original]
    assert len({h for r in requests for h in r.hash_ids}) == len(
        {h for r in original for h in r.hash_ids}
    )
    write_agentic(read, tmp_path / "again.jsonl")
    assert (tmp_path / "again.jsonl").read_text() == path.read_text()
