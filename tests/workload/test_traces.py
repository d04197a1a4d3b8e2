"""Trace importers: the three formats, session reconstruction, bad lines, scaling."""

from __future__ import annotations

import json
import logging
from itertools import pairwise
from pathlib import Path

import pytest

from kvtier.errors import KvtierError
from kvtier.workload.bailian import load_bailian
from kvtier.workload.generator import generate
from kvtier.workload.model import flatten
from kvtier.workload.mooncake import load_mooncake, reconstruct_sessions
from kvtier.workload.records import TraceRecord
from kvtier.workload.scale import scale_to_context
from kvtier.workload.sharegpt import load_sharegpt
from kvtier.workload.text import approx_tokens
from kvtier.workload.traces import detect_format, load_trace

DATA = Path(__file__).parent / "data"
# CI checks the project out next to shared/, which holds the real traces
MOONCAKE = Path(__file__).parents[2].parent / "shared/traces/mooncake_conversation_trace.jsonl"


def _turn_lengths(workload):
    return {s.session_id: [t.prompt_tokens for t in s.turns] for s in workload.sessions}


def test_formats_are_detected_from_their_fields():
    assert detect_format(DATA / "mooncake_small.jsonl") == "mooncake"
    assert detect_format(DATA / "bailian_small.jsonl") == "bailian"
    assert detect_format(DATA / "sharegpt_small.json") == "sharegpt"


def test_mooncake_continuations_follow_whole_block_prefixes():
    workload = load_mooncake(DATA / "mooncake_small.jsonl", shared_fanout=2)
    # block 0 starts every request and two distinct whole blocks follow it: a system prompt
    assert _turn_lengths(workload) == {
        "mooncake_small-0": [1200, 1900, 2600, 2600],  # longest prefix wins, then the latest
        "mooncake_small-1": [700],
        "mooncake_small-3": [800],  # shares only the system prompt with line 2
        "mooncake_small-4": [1100],
    }
    session = workload.sessions[0]
    assert [t.arrival_s for t in session.turns] == [0.0, 20.0, 50.0, 55.0]
    assert session.turns[1].user_tokens == 1900 - 1200 - 100
    assert session.turns[1].hash_ids == (0, 1, 4, 5)
    assert "512 tokens before 2 successors" in workload.notes[0]


def test_without_shared_prefix_detection_unrelated_requests_chain_through_block_zero():
    workload = load_mooncake(DATA / "mooncake_small.jsonl", shared_fanout=16)
    assert _turn_lengths(workload)["mooncake_small-1"] == [700, 800, 1100]


def test_bad_lines_are_reported_with_their_numbers_and_the_rest_is_read(caplog):
    with caplog.at_level(logging.WARNING, logger="kvtier.workload"):
        workload = load_trace(DATA / "mooncake_small.jsonl")
    assert workload.num_turns == 7
    assert [e.split(":")[0] for e in workload.errors] == ["line 8", "line 9", "line 11", "line 12"]
    assert "not valid JSON" in workload.errors[0]
    assert "missing field 'input_length'" in workload.errors[1]
    assert "'input_length' must be a whole number >= 1, not -5" in workload.errors[2]
    assert "'hash_ids' must be a list of integers" in workload.errors[3]
    assert "skipped 4 bad record(s); first: line 8" in caplog.text


def test_a_file_without_a_valid_line_is_an_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0}\n[1, 2]\n')
    with pytest.raises(KvtierError, match=r"no valid record \(2 bad; first error: line 1: "):
        load_trace(path, "mooncake")
    with pytest.raises(KvtierError, match="trace file not found"):
        load_trace(tmp_path / "missing.jsonl")
    with pytest.raises(KvtierError, match="unknown trace format 'csv'"):
        load_trace(path, "csv")
    (tmp_path / "odd.jsonl").write_text('{"prompt": "hi"}\n')
    with pytest.raises(KvtierError, match=r"cannot tell the format.*prompt"):
        load_trace(tmp_path / "odd.jsonl")


def test_bailian_sessions_follow_the_parent_chain(caplog):
    workload = load_bailian(DATA / "bailian_small.jsonl")
    assert _turn_lengths(workload) == {
        "bailian_small-0": [40, 70, 100],
        "bailian_small-1": [20, 140],
        "bailian_small-5": [30],  # its parent 99 is not in the file
    }
    assert [s.app_class for s in workload.sessions] == ["text", "image", "text"]
    assert workload.sessions[1].turns[1].hash_ids == ()
    assert workload.sessions[0].turns[1].user_tokens == 70 - 40 - 20
    assert [e.split(":")[0] for e in workload.errors] == ["line 5", "line 6", "line 9"]
    assert "'timestamp' must be a number" in workload.errors[1]
    assert "chat_id '3' repeats" in workload.errors[2]
    assert "1 request(s) name a parent that is not earlier in the file" in workload.notes[0]
    assert "skipped 3 bad record(s)" in caplog.text


def test_sharegpt_turns_pair_user_messages_with_answers():
    workload = load_sharegpt(DATA / "sharegpt_small.json", seed=4)
    a, b = workload.sessions
    assert a.system_prompt == "You answer questions about trains in plain words."
    assert [t.user_text for t in a.turns][-1] == "Thank you."
    assert a.turns[0].answer_text == "Because the timetable keeps slack where delays gather."
    assert a.turns[0].output_tokens == approx_tokens(a.turns[0].answer_text)
    assert a.turns[-1].answer_text == ""  # unanswered: the preset's mean answer length
    assert a.turns[-1].output_tokens == 300
    # ShareGPT: the leading answer is dropped, consecutive user messages are joined
    assert b.session_id == "conv-b_0"
    assert [t.user_text for t in b.turns] == [
        "How do I bake bread at home?",
        "How long should it rise?\nAnd how hot should the oven be?",
    ]
    assert workload.errors == [
        "item 3: conversation 'conv-c': needs a 'messages' or 'conversations' list",
        "item 4: conversation 'conv-d': message 0 has role 'narrator'",
    ]


def test_sharegpt_times_come_from_the_generator_model():
    workload = load_sharegpt(DATA / "sharegpt_small.json", seed=4)
    for session in workload.sessions:
        for before, after in pairwise(session.turns):
            assert after.think_s > 0
            assert after.arrival_s == pytest.approx(
                before.arrival_s + before.output_tokens / 50.0 + after.think_s
            )
    again = load_sharegpt(DATA / "sharegpt_small.json", seed=4)
    other = load_sharegpt(DATA / "sharegpt_small.json", seed=5)
    arrivals = [[t.arrival_s for t in s.turns] for s in workload.sessions]
    assert arrivals == [[t.arrival_s for t in s.turns] for s in again.sessions]
    assert arrivals != [[t.arrival_s for t in s.turns] for s in other.sessions]


def test_sharegpt_json_lines_are_read_too(tmp_path):
    conversations = json.loads((DATA / "sharegpt_small.json").read_text())
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps(c) for c in conversations) + "\n")
    workload = load_trace(path)
    assert len(workload.sessions) == 2
    assert workload.errors[0].startswith("line 3: ")


def test_scaling_fits_the_longest_prompt_and_answer_into_the_context():
    workload = load_mooncake(DATA / "mooncake_small.jsonl", shared_fanout=2)
    scaled = scale_to_context(workload, 1000)
    requests = flatten(scaled)
    assert max(r.prompt_tokens + r.output_tokens for r in requests) <= 1000
    assert scaled.length_scale == pytest.approx(1000 / (2600 + 90))
    assert requests[0].hash_ids == flatten(workload)[0].hash_ids
    assert requests[0].block_tokens == pytest.approx(512 * 1000 / 2690)
    assert "lengths scaled by 0.3717" in scaled.notes[-1]
    # a workload that already fits is left as it is
    assert scale_to_context(workload, 10_000).length_scale == 1.0


def test_scaling_cuts_text_workloads_too():
    workload = generate("quick", seed=0)
    scaled = scale_to_context(workload, 600)
    requests = flatten(scaled)
    assert max(r.prompt_tokens + r.output_tokens for r in requests) <= 600
    first = scaled.sessions[0].turns[0]
    assert len(first.user_text.split()) < len(workload.sessions[0].turns[0].user_text.split())


def test_reconstruction_takes_the_latest_of_equal_candidates():
    def record(t, blocks):
        return TraceRecord(t, 512 * len(blocks), 10, tuple(blocks))

    records = [record(0, [7, 1]), record(1, [7, 1]), record(2, [7, 1, 2])]
    assert reconstruct_sessions(records, 512, shared_fanout=16).parent == [None, 0, 1]


@pytest.mark.skipif(not MOONCAKE.is_file(), reason=f"real Mooncake trace not at {MOONCAKE}")
def test_real_mooncake_trace():
    workload = load_trace(MOONCAKE)
    assert workload.errors == []
    assert workload.num_turns == 12_031
    assert len(workload.sessions) == 8_056
    assert "3,975 of 12,031 requests continue" in workload.notes[0]
    assert "512 tokens before 6,047 successors" in workload.notes[0]
    scaled = scale_to_context(workload, 8192)
    assert max(r.prompt_tokens + r.output_tokens for r in flatten(scaled)) <= 8192
