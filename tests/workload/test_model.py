"""Flattening sessions into requests: prompts resend the history, prefixes are keyed like a
prefix cache keys them."""

from __future__ import annotations

import math
from dataclasses import replace
from itertools import pairwise

import pytest

from kvtier.workload.blocks import BlockHasher, content_key
from kvtier.workload.generator import generate
from kvtier.workload.model import Session, Turn, Workload, flatten


def _chat(block_size: int = 4) -> Workload:
    turns = [
        Turn(0.0, 3, 5, "hello there friend", "five words of answer here"),
        Turn(10.0, 2, 4, "and then", "four more answer words"),
        Turn(20.0, 6, 1, "the third message is rather long", "ok"),
    ]
    session = Session("a", turns, system_prompt="be brief now", system_tokens=3)
    return Workload([session], source="test", block_size=block_size)


def test_prompt_is_system_plus_whole_history_plus_new_message():
    requests = flatten(_chat())
    assert [r.prompt_tokens for r in requests] == [3 + 3, 3 + 3 + 5 + 2, 3 + 3 + 5 + 2 + 4 + 6]
    last = requests[-1].messages
    assert [m["role"] for m in last] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert last[0]["content"] == "be brief now"
    assert last[2]["content"] == "five words of answer here"
    assert last[-1]["content"] == "the third message is rather long"
    assert [r.request_id for r in requests] == ["a/0", "a/1", "a/2"]


def test_history_budget_drops_the_oldest_turns_whole():
    requests = flatten(_chat(), max_history_tokens=7)
    # turn 2: history (3+5) + (2+4) = 14 > 7; only the newest pair (6) fits
    assert requests[2].prompt_tokens == 3 + 2 + 4 + 6
    assert [m["content"] for m in requests[2].messages[1:3]] == [
        "and then",
        "four more answer words",
    ]
    assert requests[2].messages[0]["role"] == "system"
    # the workload's own budget is the default
    assert flatten(replace(_chat(), max_history_tokens=7))[2].prompt_tokens == 15


def test_next_turn_reuses_every_whole_block_of_the_previous_prompt():
    requests = flatten(_chat(block_size=4))
    for before, after in pairwise(requests):
        whole = before.prompt_tokens // 4
        assert after.hash_ids[:whole] == before.hash_ids[:whole]
        # the previous partial block is rehashed once more tokens fill it
        if before.prompt_tokens % 4:
            assert after.hash_ids[whole] != before.hash_ids[whole]
    assert all(len(r.hash_ids) == math.ceil(r.prompt_tokens / 4) for r in requests)


def test_truncated_history_breaks_the_prefix_after_the_system_prompt():
    # budget 8: turn 1 resends turn 0 (8 tokens); turn 2 can only resend turn 1
    requests = flatten(_chat(block_size=1), max_history_tokens=8)
    assert requests[1].prompt_tokens == 3 + 8 + 2
    assert requests[2].hash_ids[:3] == requests[1].hash_ids[:3]  # system prompt
    assert requests[2].hash_ids[3] != requests[1].hash_ids[3]


def test_sessions_share_the_blocks_of_a_common_system_prompt():
    workload = generate("default", seed=0)
    firsts = {}
    for request in flatten(workload):
        if request.turn_index == 0:
            firsts.setdefault(request.app_class, []).append(request)
    for requests in firsts.values():
        system_blocks = workload.sessions[0].system_tokens // workload.block_size
        assert len({r.hash_ids[:system_blocks] for r in requests}) == 1
    assert len({rs[0].hash_ids[0] for rs in firsts.values()}) == len(firsts)


def test_recorded_trace_turns_pass_through():
    turn = Turn(1.5, 10, 7, prompt_tokens=1000, hash_ids=(4, 5))
    workload = Workload([Session("t", [turn])], source="trace", block_size=512, length_scale=0.5)
    (request,) = flatten(workload)
    assert (request.prompt_tokens, request.hash_ids, request.block_tokens) == (1000, (4, 5), 256)
    assert request.messages == []


def test_requests_are_ordered_by_arrival_across_sessions():
    workload = generate("quick", seed=3)
    arrivals = [r.arrival_s for r in flatten(workload)]
    assert arrivals == sorted(arrivals)
    assert len(arrivals) == workload.num_turns


def test_block_ids_are_chained_and_stable():
    hasher = BlockHasher(4)
    a = hasher.block_ids([(content_key("x"), 6), (content_key("y"), 3)])
    b = hasher.block_ids([(content_key("x"), 6), (content_key("z"), 3)])
    assert len(a) == 3 and a[0] == b[0] and a[1] != b[1]
    # the same prompt from a fresh hasher gets the same ids (no per-process salt)
    assert BlockHasher(4).block_ids([(content_key("x"), 6), (content_key("y"), 3)]) == a
    # known leading blocks are taken as given, the rest hashed as usual
    assert hasher.block_ids([(content_key("x"), 6), (content_key("y"), 3)], known=a[:1]) == a
    with pytest.raises(ValueError):
        BlockHasher(0)
